"""labkit.data refuses what is not text with one clear ValueError, checks the sequence length at
load time, and reads only the bytes it uses."""
import os
import tracemalloc

import pytest

from labkit.data import Corpus, load_bytes


def test_binary_and_special_files_are_refused(tmp_path):
    exe = tmp_path / "a.bin"
    exe.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(4000))
    with pytest.raises(ValueError, match=r"--data .*a.bin: does not look like text"):
        Corpus.load(exe)
    with pytest.raises(ValueError, match="--data /dev/null: exists but is not a regular text file or folder"):
        Corpus.load("/dev/null")
    # inside a folder a binary file is skipped, the text is used
    (tmp_path / "notes.txt").write_text("plain text, é ü, tabs\tand\nnewlines\n" * 100)
    (tmp_path / "z.txt").write_bytes(bytes(range(256)) * 10)
    assert b"\x00" not in load_bytes(tmp_path)


def test_sequence_length_is_checked_when_loading(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("x = 1\n" * 500)  # 3000 bytes: val split 300 tokens
    Corpus.load(f, block_size=250)
    with pytest.raises(ValueError, match=r"the val split has 300 tokens, too few for sequences of 350 tokens"):
        Corpus.load(f, block_size=350)


def test_get_batch_rejects_unknown_split():
    c = Corpus.load(max_bytes=100_000)
    with pytest.raises(ValueError, match="split must be 'train' or 'val', got 'test'"):
        c.get_batch("test", 2, 8)


def test_reads_only_what_it_uses(tmp_path):
    """A 1 GiB file (sparse: no disk) costs max_bytes of memory, not 1 GiB."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(b"print('hello world')\n" * 200_000)  # 4.2 MB of text, then a hole
        f.truncate(2**30)
    assert os.path.getsize(big) == 2**30
    tracemalloc.start()
    try:
        c = Corpus.load(big, max_bytes=1_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(c.train) + len(c.val) == 1_000_000
    assert peak < 40 * 2**20, peak
