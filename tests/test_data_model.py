"""The corpus and the reference GPT."""
import math

import pytest
import torch

from labkit.data import Corpus, load_bytes, stdlib_files
from labkit.model import GPT, GPTConfig, lm_loss


def test_stdlib_corpus_is_real_and_deterministic():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert "site-packages" not in {p for f in files for p in f.parts}
    a, b = load_bytes(max_bytes=100_000), load_bytes(max_bytes=100_000)
    assert a == b and len(a) == 100_000
    assert b"def " in a and b"import" in a


def test_data_path_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 200)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("second file " * 200)
    c = Corpus.load(tmp_path)
    raw = bytes(torch.cat([c.train, c.val]).tolist())
    assert raw.startswith(b"hello world") and raw.endswith(b"second file ")
    c1 = Corpus.load(tmp_path / "a.txt")
    assert len(c1.train) + len(c1.val) == 2400
    with pytest.raises(FileNotFoundError, match="no such file"):
        Corpus.load(tmp_path / "missing")


def test_batches_are_pure_functions_of_step_and_seed():
    c = Corpus.load(max_bytes=200_000)
    x1, y1 = c.get_batch("train", 4, 16, step=3, seed=1)
    x2, y2 = c.get_batch("train", 4, 16, step=3, seed=1)
    x3, _ = c.get_batch("train", 4, 16, step=4, seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.shape == (4, 16) and x1.dtype == torch.long
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    xv, _ = c.get_batch("val", 4, 16, step=3, seed=1)
    assert not torch.equal(xv, x1)


def test_gpt_is_deterministic_from_seed_and_predicts_uniformly_at_init():
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)
    a, b, c = GPT(cfg, seed=0), GPT(cfg, seed=0), GPT(cfg, seed=1)
    for (n, p), (_, q), (_, _r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.blocks[0].mlp.fc1.weight, c.blocks[0].mlp.fc1.weight)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = a(idx)
    assert logits.shape == (2, 16, 256)
    loss = a(idx, idx)
    assert abs(loss.item() - math.log(256)) < 0.1
    assert torch.equal(loss, lm_loss(logits, idx))


def test_gpt_is_causal():
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, block_size=16)
    m = GPT(cfg, seed=0)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    idx2 = idx.clone()
    idx2[0, 10] = (idx2[0, 10] + 1) % 256
    a, b = m(idx), m(idx2)
    assert torch.equal(a[0, :10], b[0, :10]) and not torch.equal(a[0, 10:], b[0, 10:])


def test_config_errors_name_sizes():
    with pytest.raises(ValueError, match="n_embd=30 must be divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_head=4 must be divisible by n_kv_head=3"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="block_size=16"):
        GPT(GPTConfig(block_size=16, n_layer=1))(torch.zeros(1, 17, dtype=torch.long))
