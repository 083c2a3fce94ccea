"""IDX reader: round trips, every validation path, hostile headers and a fuzz test."""
import gzip
import os
import tempfile
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcnn.data import DataError, read_idx, read_idx_images, read_idx_labels


@pytest.mark.parametrize("gz", [False, True])
def test_round_trip_detects_compression_by_content(tmp_path, rng, fmt, gz):
    images = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    # The name says the opposite of the content: detection must use the magic bytes.
    path = fmt.write_idx(tmp_path / ("images" if gz else "images.gz"), images, gz=gz)
    got = read_idx_images(path)
    assert got.shape == (5, 7, 3, 1) and got.dtype == np.uint8
    np.testing.assert_array_equal(got[..., 0], images)
    assert got.flags.writeable


def test_other_idx_dtypes_are_big_endian(tmp_path):
    values = np.array([[1, -2], [300, -40000]], np.int32)
    path = tmp_path / "ints"
    path.write_bytes((0x00000C02).to_bytes(4, "big") + b"\0\0\0\x02\0\0\0\x02" + values.astype(">i4").tobytes())
    got = read_idx(path)
    np.testing.assert_array_equal(got, values)
    assert got.dtype.isnative


@pytest.mark.parametrize("gz", [False, True])
def test_bad_magic_names_file_and_magic(tmp_path, rng, fmt, gz):
    path = fmt.write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 9, (2, 3, 3)), gz=gz,
                         magic=0x00000802, dims=(2, 9))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz: bad magic 0x00000802, expected 0x00000803"):
        read_idx_images(path)


def test_labels_file_given_as_images(tmp_path, fmt):
    path = fmt.write_idx(tmp_path / "labels", np.arange(4), gz=True)
    with pytest.raises(DataError, match="bad magic 0x00000801, expected 0x00000803"):
        read_idx_images(path)


def test_not_an_idx_file(tmp_path):
    path = tmp_path / "junk"
    path.write_bytes(b"GIF89a" + bytes(20))
    with pytest.raises(DataError, match="junk: bad magic 0x47494638, not an IDX file"):
        read_idx(path)


def test_truncated_raw_file_is_caught_from_its_size(tmp_path, rng, fmt):
    data = fmt.idx_bytes(rng.integers(0, 256, (4, 2, 2)))
    path = tmp_path / "short"
    path.write_bytes(data[:-1])
    with pytest.raises(DataError, match=r"short: header dims \(4, 2, 2\) imply 32 bytes, but the file has 31"):
        read_idx_images(path)


def test_truncated_gzip_payload(tmp_path, rng, fmt):
    data = fmt.idx_bytes(rng.integers(0, 256, (4, 2, 2)))
    path = fmt.write_idx(tmp_path / "short.gz", raw=data[:-3], gz=True)
    with pytest.raises(DataError, match="short.gz: truncated data: expected 16 bytes, file ends after 13"):
        read_idx_images(path)


def test_truncated_header(tmp_path, fmt):
    path = fmt.write_idx(tmp_path / "hdr.gz", raw=(0x00000803).to_bytes(4, "big") + b"\0\0\0\x01\0\0", gz=True)
    with pytest.raises(DataError, match="hdr.gz: truncated header"):
        read_idx_images(path)


@pytest.mark.parametrize("gz", [False, True])
def test_trailing_bytes(tmp_path, rng, fmt, gz):
    path = fmt.write_idx(tmp_path / "long", raw=fmt.idx_bytes(rng.integers(0, 10, 6)) + b"\x01", gz=gz)
    expected = "trailing bytes" if gz else "imply 14 bytes, but the file has 15"
    with pytest.raises(DataError, match=expected):
        read_idx_labels(path)


def test_broken_gzip_stream(tmp_path, rng, fmt):
    good = gzip.compress(fmt.idx_bytes(rng.integers(0, 256, (50, 28, 28))), mtime=0)
    path = tmp_path / "corrupt.gz"
    path.write_bytes(good[:40] + bytes(b ^ 0xFF for b in good[40:80]) + good[80:])
    with pytest.raises(DataError, match="corrupt.gz: "):
        read_idx_images(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nothere: file not found"):
        read_idx(tmp_path / "nothere")


def test_labels_out_of_range(tmp_path, fmt):
    path = fmt.write_idx(tmp_path / "labels.gz", np.array([0, 9, 10, 3]), gz=True)
    with pytest.raises(DataError, match=r"labels.gz: label 10 at index 2 is out of range 0\.\.9"):
        read_idx_labels(path)


def test_empty_image_dims(tmp_path, fmt):
    path = fmt.write_idx(tmp_path / "empty", raw=fmt.idx_bytes(np.zeros((3, 0, 4))))
    with pytest.raises(DataError, match=r"empty: empty image dims"):
        read_idx_images(path)


@pytest.mark.parametrize("gz", [False, True])
def test_huge_dims_header_is_refused_before_allocating(tmp_path, fmt, gz):
    # 2**32-1 cubed bytes: reading this naively would try to allocate ~8e28 bytes.
    path = fmt.write_idx(tmp_path / "huge", np.zeros((2, 2, 2)), gz=gz, dims=(2**32 - 1,) * 3)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"huge: header dims \(4294967295, 4294967295, 4294967295\) imply "
                                            r"\d+ bytes of data, more than the \d+-byte limit"):
            read_idx_images(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_lying_gzip_header_under_the_cap_allocates_only_what_arrives(tmp_path, fmt):
    # 500 MB declared, 8 bytes present: memory must follow the data, not the header.
    path = fmt.write_idx(tmp_path / "liar.gz", np.zeros((2, 2, 2)), gz=True, dims=(500_000, 1000, 1))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="liar.gz: truncated data: expected 500000000 bytes, file ends after 8"):
            read_idx_images(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_max_bytes_caps_decompressed_size(tmp_path, fmt):
    path = fmt.write_idx(tmp_path / "big.gz", np.zeros((100, 28, 28)), gz=True)
    with pytest.raises(DataError, match="more than the 1000-byte limit"):
        read_idx_images(path, max_bytes=1000)
    assert read_idx_images(path, max_bytes=78_400).shape == (100, 28, 28, 1)


@settings(max_examples=60, deadline=None)
@given(header=st.binary(min_size=0, max_size=24), payload=st.binary(max_size=64), gz=st.booleans(),
       use_real_magic=st.booleans(),
       dims=st.lists(st.integers(0, 8) | st.integers(0, 2**32 - 1), min_size=1, max_size=3))
def test_fuzzed_headers_either_parse_consistently_or_raise_data_error(header, payload, gz, use_real_magic, dims):
    if use_real_magic:  # a plausible header with random dims, so the size checks get exercised
        header = (0x00000800 | len(dims)).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "fuzz")
        with open(path, "wb") as f:
            f.write(gzip.compress(header + payload) if gz else header + payload)
        try:
            array = read_idx(path, max_bytes=1 << 16)
        except DataError as err:
            assert str(err).startswith(path + ": ")
            return
    data = header + payload
    ndim = data[3]
    declared = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    assert array.shape == declared
    assert 4 + 4 * ndim + array.nbytes == len(data)
