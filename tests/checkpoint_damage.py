"""Damage done to a saved checkpoint's array files, for the tests of what a resume makes of it."""


def chunk_files(step_dir):
    """The tensorstore (OCDBT) chunk files of one checkpoint, largest first."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no chunk files under {step_dir}"
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def truncate(path):
    """Cut the file to half its length."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bits(path, places=8):
    """Flip one bit at each of ``places`` offsets spread evenly over the file.

    One place is not enough to be sure of damage: an OCDBT chunk file also holds b-tree nodes
    that a later commit of the same save superseded, and a flip there is never read (one
    landed there once, in CI, and the checkpoint rightly read back whole).
    """
    data = bytearray(path.read_bytes())
    for k in range(1, places + 1):
        data[len(data) * k // (places + 1)] ^= 0x10
    path.write_bytes(bytes(data))
