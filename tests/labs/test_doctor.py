"""python -m labkit doctor --run on CPU: one PASS line per lab; a broken lab is a FAIL line."""
import labkit.doctor as doctor


def test_doctor_run_passes_every_lab(capsys):
    rc = doctor.run_all()
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert rc == 0, out
    assert [ln.split()[1] for ln in lines] == ["pipeline", "tensor", "moe", "3d"]
    assert all(ln.startswith("PASS") for ln in lines)
    assert "3d        gloo  8 ranks   largest difference from one device" in out
    diff = float(lines[-1].split("one device")[1].split()[0])
    assert 0 < diff < 1e-5


def test_doctor_run_fails_a_broken_lab(capsys, monkeypatch):
    from labkit.data_parallel import ddp
    orig_init, plans = ddp.DistributedDataParallel.__init__, doctor._plans

    def no_average(self, *a, **k):        # injected bug: DP gradients summed, not averaged
        orig_init(self, *a, **k)
        self.d = 1
    monkeypatch.setattr(ddp.DistributedDataParallel, "__init__", no_average)
    monkeypatch.setattr(doctor, "_plans", lambda world, out: [p for p in plans(world, out) if p[0] == "3d"])
    rc = doctor.run_all()
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  3d" in out and "some labs FAILED" in out


def test_doctor_3d_run_has_ignored_targets_and_catches_the_per_shard_mean(capsys, monkeypatch):
    import labkit.parallel.gpt as gpt
    plans = doctor._plans
    assert any("--ignore-frac" in argv for name, _, argv in plans(None, "x") if name == "3d")
    # injected bug: each microbatch's own token mean (invisible on batches where every target is valid)
    monkeypatch.setattr(gpt, "_piece_loss", lambda head, tokens, output, target: head.loss(output, target))
    monkeypatch.setattr(doctor, "_plans", lambda world, out: [p for p in plans(world, out) if p[0] == "3d"])
    rc = doctor.run_all()
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL  3d" in out, out
