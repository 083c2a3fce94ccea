"""Image folders: scanning, decoding every mode to RGB, and one-line errors naming the bad file."""
import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from jaxcnn.data.folder import FolderSource, decode_image, read_file, scan_folder, scan_split
from jaxcnn.data.shapes import write_shapes_folder
from jaxcnn.errors import BadImageError, DataError


def _save(path, array, mode=None, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image = Image.fromarray(array)
    if mode:
        image = image.convert(mode)
    image.save(path, **kw)
    return path


def test_scan_orders_classes_and_files(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("zebra", "ant", "Moth"):  # sorted as strings: "Moth" < "ant" < "zebra"
            for name in ("b.png", "a.jpg", "c.JPEG"):
                _save(str(tmp_path / split / cls / name), rng.integers(0, 255, (8, 9, 3), dtype=np.uint8))
    (tmp_path / "train" / "ant" / ".DS_Store").write_bytes(b"x")  # hidden: ignored
    index = scan_folder(tmp_path)
    assert index["train"].class_names == ("Moth", "ant", "zebra")
    assert index["train"].paths[:3] == ("Moth/a.jpg", "Moth/b.png", "Moth/c.JPEG")
    assert index["train"].labels == (0, 0, 0, 1, 1, 1, 2, 2, 2)
    source = FolderSource(index["val"])
    payload, label, name = source[4]
    assert label == 1 and name.endswith(os.path.join("val", "ant", "b.png"))
    assert payload == open(name, "rb").read()


@pytest.mark.parametrize("mode,ext", [("L", "png"), ("LA", "png"), ("P", "png"), ("RGBA", "png"),
                                      ("CMYK", "jpg"), ("L", "jpg"), ("I;16", "png"), ("1", "png")])
def test_decode_converts_every_mode_to_rgb(tmp_path, mode, ext):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 255, (11, 7, 3), dtype=np.uint8)
    if mode == "I;16":
        grey = rng.integers(0, 65536, (11, 7), dtype=np.uint16)
        Image.fromarray(grey).save(tmp_path / f"x.{ext}")
        expect = np.repeat(np.clip(np.rint(grey / 65535.0 * 255.0), 0, 255).astype(np.uint8)[..., None], 3, -1)
    else:
        _save(str(tmp_path / f"x.{ext}"), rgb, mode)
        # Reference: Pillow's own conversion of the decoded file (alpha dropped, as ImageFolder does).
        expect = np.asarray(Image.open(tmp_path / f"x.{ext}").convert("RGB"))
    image = decode_image(read_file(str(tmp_path / f"x.{ext}")), "x")
    assert image.mode == "RGB" and image.size == (7, 11)
    np.testing.assert_array_equal(np.asarray(image), expect)
    if ext == "png" and mode in ("RGBA",):  # lossless: the colour channels survive exactly
        np.testing.assert_array_equal(np.asarray(image), rgb)


def _bad_folder(tmp_path):
    write_shapes_folder(tmp_path, per_class=(2, 1), classes=["red", "blue"], size_range=(16, 20))
    return tmp_path


def test_missing_split_empty_class_no_classes(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        scan_folder(tmp_path / "nope")
    root = _bad_folder(tmp_path)
    with pytest.raises(DataError, match=r"missing split 'test'") as err:
        scan_split(root, "test")
    assert str(tmp_path / "test") in str(err.value) and "\n" not in str(err.value)
    os.makedirs(root / "train" / "green")
    with pytest.raises(DataError, match="empty class folder") as err:
        scan_folder(root)
    assert str(root / "train" / "green") in str(err.value)
    os.rmdir(root / "train" / "green")
    (root / "train" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="not a class folder"):
        scan_folder(root)
    os.unlink(root / "train" / "notes.txt")
    os.makedirs(tmp_path / "e" / "train")
    with pytest.raises(DataError, match="no class folders"):
        scan_split(tmp_path / "e", "train")


def test_val_classes_must_match_train(tmp_path):
    root = _bad_folder(tmp_path)
    os.rename(root / "val" / "red", root / "val" / "crimson")
    with pytest.raises(DataError, match=r"differ from the training split's \(missing \['red'\], extra \['crimson'\]\)"):
        scan_folder(root)


def test_non_image_file_fails_or_is_skipped(tmp_path):
    root = _bad_folder(tmp_path)
    stray = root / "train" / "red" / "labels.csv"
    stray.write_text("a,b")
    with pytest.raises(DataError, match="not an image file") as err:
        scan_folder(root)
    assert str(stray) in str(err.value)
    index = scan_folder(root, on_bad_image="skip")
    assert index["train"].skipped == (str(stray),) and len(index["train"]) == 4


def test_os_metadata_files_and_folders_are_not_data(tmp_path):
    """Thumbs.db, desktop.ini (any case) and a zip's __MACOSX/ were errors under on_bad_image:
    fail ("not an image file", "not a class folder") or a class of their own; only dot-files
    were skipped."""
    root = _bad_folder(tmp_path)
    before = scan_folder(root)
    for split in ("train", "val"):
        (root / split / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
        (root / split / "desktop.ini").write_text("[.ShellClassInfo]")
        (root / split / "__MACOSX" / "red").mkdir(parents=True)  # unzipped on Linux: a third class
        (root / split / "__MACOSX" / "red" / "._0.png").write_bytes(b"\x00\x05\x16\x07")
        for cls in ("red", "blue"):
            (root / split / cls / "thumbs.DB").write_bytes(b"\xd0\xcf\x11\xe0")
            (root / split / cls / "Desktop.ini").write_text("[.ShellClassInfo]")
            (root / split / cls / "Icon\r").write_bytes(b"")
            (root / split / cls / "@eaDir").mkdir()
            (root / split / cls / "@eaDir" / "x.jpg").write_bytes(b"a NAS thumbnail")
    after = scan_folder(root)  # on_bad_image: fail
    assert after == before and after["train"].skipped == ()
    # Names that only look alike are still data: a class folder, a stray file.
    (root / "train" / "MACOSX").mkdir()
    with pytest.raises(DataError, match="MACOSX: empty class folder"):
        scan_folder(root)
    shutil.rmtree(root / "train" / "MACOSX")
    (root / "train" / "red" / "thumbs.db.txt").write_text("x")
    with pytest.raises(DataError, match="thumbs.db.txt: not an image file"):
        scan_folder(root)


def test_bad_files_raise_bad_image_error_naming_the_file(tmp_path):
    rng = np.random.default_rng(2)
    good = _save(str(tmp_path / "good.jpg"), rng.integers(0, 255, (32, 32, 3), dtype=np.uint8), quality=95)
    data = open(good, "rb").read()
    cases = {
        "truncated.jpg": (data[:len(data) // 2], "corrupt or truncated"),
        "garbage.jpg": (b"\xff\xd8\xff\xe0" + bytes(rng.integers(0, 255, 300, dtype=np.uint8)), "corrupt or truncated"),
        "text.png": (b"hello, I am not a picture", "not an image"),
        "empty.jpg": (b"", "empty file"),
    }
    for name, (payload, message) in cases.items():
        (tmp_path / name).write_bytes(payload)
        with pytest.raises(BadImageError, match=message) as err:
            decode_image(read_file(str(tmp_path / name)), str(tmp_path / name))
        assert str(tmp_path / name) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(BadImageError, match="unreadable"):
        read_file(str(tmp_path / "missing.jpg"))
    os.mkfifo(tmp_path / "fifo.jpg")
    with pytest.raises(BadImageError, match="not a regular file"):  # never opened: it would block
        read_file(str(tmp_path / "fifo.jpg"))
    if os.geteuid() != 0:  # root reads anything
        os.chmod(good, 0)
        with pytest.raises(BadImageError, match="unreadable"):
            read_file(good)


def test_shapes_folder_has_mixed_modes_and_sizes(tmp_path):
    written = write_shapes_folder(tmp_path, per_class=(6, 2), classes=["red", "green"], size_range=(16, 40))
    assert len(written["train"]) == 12 and len(written["val"]) == 4
    modes = {Image.open(p).mode for p in written["train"]}
    sizes = {Image.open(p).size for p in written["train"]}
    assert {"RGB", "RGBA", "P", "CMYK"} <= modes and len(sizes) > 3
    index = scan_folder(tmp_path)
    assert index["train"].class_names == ("green", "red")


def _image(path, seed=3):
    return _save(str(path), np.random.default_rng(seed).integers(0, 255, (8, 8, 3), dtype=np.uint8))


def _two_classes(root):
    for split in ("train", "val"):
        for cls in ("a", "b"):
            _image(root / split / cls / "x.png")


def test_linked_folders_inside_the_folder_are_followed_once(tmp_path):
    """A link back to a parent folder made the walk endless; a linked folder of images inside
    the image folder is read, and a link back into the same class is left out (listed once)."""
    _two_classes(tmp_path)
    _image(tmp_path / "elsewhere" / "y.png")
    os.symlink(tmp_path / "elsewhere", tmp_path / "train" / "a" / "more")
    os.makedirs(tmp_path / "train" / "a" / "sub")
    os.symlink(tmp_path / "train" / "a", tmp_path / "train" / "a" / "sub" / "up")
    os.symlink(tmp_path / "train" / "a" / "x.png", tmp_path / "train" / "a" / "sub" / "again.png")
    index = scan_folder(tmp_path)
    assert index["train"].paths == ("a/more/y.png", "a/x.png", "b/x.png")


@pytest.mark.parametrize("link,target,says", [
    ("train/a/loop_up", "train", "its images would be in split 'train' and in class 'a' of split 'train'"),
    ("train/a/b_too", "train/b", "in class 'a' of split 'train' and in class 'b' of split 'train'"),
    ("val/a/seen_in_training", "train/a", "in class 'a' of split 'train' and in class 'a' of split 'val'"),
    ("val/b/copy.png", "train/b/x.png", "in class 'b' of split 'train' and in class 'b' of split 'val'"),
])
def test_a_link_into_another_class_or_split_is_an_error(tmp_path, link, target, says):
    """A loop up to the split folder pulled every class into one (107 images listed for 51
    files) and val/ into train/; a link into another class or split mixed them silently."""
    _two_classes(tmp_path)
    os.symlink(tmp_path / target, tmp_path / link)
    with pytest.raises(DataError, match="the same (folder|file) as ") as err:
        scan_folder(tmp_path)
    assert str(err.value).startswith(str(tmp_path / link) + ": ") and says in str(err.value)


def test_a_link_out_of_the_image_folder_is_an_error_unless_asked(tmp_path):
    """A class folder linked to / walked the whole file system (421,414 files)."""
    root = tmp_path / "data"
    _two_classes(root)
    _image(tmp_path / "outside" / "far.png")
    os.symlink(tmp_path / "outside", root / "train" / "b" / "far")
    with pytest.raises(DataError, match=r"a link to .*outside, outside the image folder .*data \(set "
                                        r"data.outside_links: true"):
        scan_folder(root)
    index = scan_folder(root, outside_links=True)
    assert index["train"].paths == ("a/x.png", "b/far/far.png", "b/x.png")
    os.symlink(root, tmp_path / "via_link")  # the image folder given through a link is inside
    assert scan_folder(tmp_path / "via_link", outside_links=True)["train"].paths == index["train"].paths


def test_a_folder_that_cannot_be_listed_is_an_error_or_skipped_and_named(tmp_path, monkeypatch):
    """An unreadable sub-folder (16 images) was left out without a word, even under
    data.on_bad_image=fail, and an unreadable class folder was called empty. (The suite may run
    as root, whom permissions do not stop: os.scandir is made to refuse instead.)"""
    _two_classes(tmp_path)
    _image(tmp_path / "train" / "a" / "locked" / "z.png")
    scandir = os.scandir

    def refusing(path):
        if os.path.basename(path) == "locked" or path == str(tmp_path / "val" / "b"):
            raise PermissionError(13, "Permission denied", path)
        return scandir(path)
    monkeypatch.setattr(os, "scandir", refusing)
    locked = tmp_path / "train" / "a" / "locked"
    with pytest.raises(DataError, match=f"{locked}: cannot list \\(Permission denied\\); fix its "
                                        "permissions, or set data.on_bad_image: skip"):
        scan_split(tmp_path, "train")
    index = scan_split(tmp_path, "train", on_bad_image="skip")
    assert index.paths == ("a/x.png", "b/x.png")
    assert index.unlisted == (f"{locked}: cannot list (Permission denied)",)
    with pytest.raises(DataError, match=f"{tmp_path / 'val' / 'b'}: cannot list"):
        scan_split(tmp_path, "val", on_bad_image="skip")  # a whole class: never skipped
    from jaxcnn.data.images import ImageData
    monkeypatch.setattr(os, "scandir", lambda path: refusing(path) if "val" not in str(path)
                        else scandir(path))
    note = ImageData("folder", tmp_path, image_size=(8, 8), on_bad_image="skip").skipped_note()
    assert note == (f"1 folder left out of {tmp_path} (cannot be listed: {locked}: cannot list "
                    "(Permission denied); data.on_bad_image is skip)")


def test_a_folder_of_class_folders_or_a_split_given_as_the_root_is_named_so(tmp_path):
    """ImageFolder's own layout (ROOT/<class>/<image>, no split folders) and data.path set to
    the train split itself: both said only 'missing split' and listed the class folders."""
    write_shapes_folder(tmp_path / "root", per_class=(2, 1), classes=["red", "blue"], size_range=(16, 20))
    split = tmp_path / "root" / "train"
    with pytest.raises(DataError) as err:
        scan_folder(split)
    assert str(err.value).endswith(f"found folders ['blue', 'red']; {split} is itself a split: the image "
                                   f"folder is {tmp_path / 'root'})")
    flat = tmp_path / "flat"
    shutil.copytree(split, flat)
    with pytest.raises(DataError) as err:
        scan_folder(flat)
    assert str(err.value).endswith(f"these look like class folders: set data.val_split (e.g. 0.1) to hold "
                                   f"out a share of each class in code, or put them under {flat / 'train'} and a "
                                   f"validation share of each class under {flat / 'val'})")
    for name in os.listdir(flat / "blue"):
        (flat / "blue" / name).unlink()
    with pytest.raises(DataError) as err:  # not every folder holds images: no guess
        scan_folder(flat)
    assert str(err.value).endswith("found folders ['blue', 'red'])")


def test_pillows_warning_about_an_image_is_said_once_per_file():
    """A JPEG with corrupt EXIF data printed Pillow's warning at every decode (every epoch): the
    decode's own warning filters made Python forget the warnings it had shown."""
    import io
    import warnings

    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(
        buffer, "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x05\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06bad")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for name in ("a.jpg", "b.jpg", "a.jpg", "b.jpg", "a.jpg"):
            decode_image(buffer.getvalue(), f"/data/{name}")
    said = [str(w.message) for w in caught]
    assert len(said) == 2 and said[0].startswith("/data/a.jpg: Corrupt EXIF data") and \
        said[1].startswith("/data/b.jpg: "), said


# ------------------------------------------------------------ data.val_split

def _class_folders(root, counts, under=""):
    """``root/under/c<i>/<nn>.png``: ``counts[i]`` tiny PNGs in class ``c<i>`` (ImageFolder's layout)."""
    rng = np.random.default_rng(0)
    for c, n in enumerate(counts):
        for i in range(n):
            _save(str(root / under / f"c{c}" / f"{i:02d}.png"), rng.integers(0, 255, (4, 5, 3), dtype=np.uint8))
    return root


def _split(root, source="folder", **kw):
    from jaxcnn.data.images import ImageData
    return ImageData(source, root, image_size=(4, 4), **{"val_split": 0.2, "seed": 3, **kw})


def _paths(side):
    return [side.index.paths[i] for i in range(len(side))]


def test_held_out_count_rounds_halves_up_and_keeps_a_side_for_each_class():
    from jaxcnn.data.split import held_out_count
    assert [held_out_count(n, 0.25) for n in (0, 1, 2, 3, 4, 10, 12, 100)] == [0, 0, 1, 1, 1, 3, 3, 25]
    assert held_out_count(2, 0.99) == 1 and held_out_count(50, 0.01) == 1 and held_out_count(50, 0.99) == 49


def test_val_split_is_stratified_seeded_and_a_partition_of_the_folder(tmp_path):
    root = _class_folders(tmp_path / "f", [1, 2, 5, 10, 21])
    a = _split(root)
    # round(0.2 * n), at least one of a class of two or more; a class of one image keeps it
    assert a.split["per_class"] == {"c0": [1, 0], "c1": [1, 1], "c2": [4, 1], "c3": [8, 2], "c4": [17, 4]}
    assert a.split_note() == (f"data: folder {root}, 5 classes, 31 train / 8 val (val_split 0.2, stratified, "
                              f"seed 3; 1 class of one image, kept for training)")
    train, val = _paths(a.train), _paths(a.val)
    assert not set(train) & set(val)
    on_disk = sorted(str(p.relative_to(root)) for p in root.rglob("*.png"))
    assert sorted(train + val) == on_disk and train == sorted(train) and val == sorted(val)
    assert all(a.class_names[label] == path.split("/")[0]
               for side in (a.train, a.val) for path, label in zip(side.index.paths, side.index.labels))
    assert _paths(_split(root).val) == val  # the same on a second scan
    assert _paths(_split(root, seed=4).val) != val
    # the split is a fixed function of (seed, class, position): here by hand, in Python ints
    expect = []
    for c, (name, (_, k)) in enumerate(a.split["per_class"].items()):
        keys = _reference_keys(3, c, sum(a.split["per_class"][name]))
        expect += [f"{name}/{i:02d}.png" for i in sorted(sorted(range(len(keys)), key=keys.__getitem__)[:k])]
    assert val == expect


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea and Flood; Vigna's splitmix64.c), on Python ints."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def _reference_keys(seed, c, n):
    golden = 0x9E3779B97F4A7C15
    base = _splitmix64((seed * golden + c + 1) % 2**64)
    return [_splitmix64(base ^ ((i + 1) * golden % 2**64)) for i in range(n)]


def test_split_keys_are_splitmix64():
    from jaxcnn.data.split import _mix, class_keys
    # splitmix64.c's first output from state 0 (the state advanced by the golden gamma, then mixed)
    assert int(_mix(np.array([0x9E3779B97F4A7C15], np.uint64))[0]) == 0xE220A8397B1DCDAF
    for seed, c, n in ((0, 0, 5), (2**32 - 1, 999, 40), (7, 3, 1)):
        assert class_keys(seed, c, n).tolist() == _reference_keys(seed, c, n)


def test_val_split_does_not_depend_on_the_listing_order(tmp_path, monkeypatch):
    import contextlib
    root = _class_folders(tmp_path / "f", [6, 9])
    before = _split(root)
    real_scandir, real_listdir = os.scandir, os.listdir

    @contextlib.contextmanager
    def backwards(path):
        with real_scandir(path) as entries:
            yield iter(list(entries)[::-1])

    monkeypatch.setattr(os, "scandir", backwards)
    monkeypatch.setattr(os, "listdir", lambda path: real_listdir(path)[::-1])
    after = _split(root)
    assert _paths(after.train) == _paths(before.train) and _paths(after.val) == _paths(before.val)
    assert after.fingerprint() == before.fingerprint()


def test_val_split_of_both_layouts_and_of_their_records_is_the_same(tmp_path):
    """PATH/<class>/<image> and PATH/train/<class>/<image> (no val/) split alike, and records
    converted from either (one split, train) split by index into the same images."""
    from jaxcnn.data.cli import main as data_main
    flat = _class_folders(tmp_path / "flat", [3, 7, 4])
    nested = _class_folders(tmp_path / "nested", [3, 7, 4], under="train")
    a, b = _split(flat), _split(nested)
    assert _paths(a.val) == _paths(b.val) and a.split == b.split and len(a.val) == 3
    for folder, name in ((flat, "rf"), (nested, "rn")):
        assert data_main(["convert", str(folder), str(tmp_path / name), "--no-progress"]) == 0
        meta = json.loads((tmp_path / name / "dataset.json").read_text())
        assert set(meta["splits"]) == {"train"} and meta["splits"]["train"]["per_class"] == [3, 7, 4]
        records = _split(tmp_path / name, "records")
        assert records.split["per_class"] == a.split["per_class"]
        for folder_side, record_side in ((a.train, records.train), (a.val, records.val)):
            assert len(record_side) == len(folder_side)
            for i in range(len(folder_side)):
                assert record_side[i][:2] == folder_side[i][:2]  # the same bytes and label
        assert records.split_note().endswith("11 train / 3 val (val_split 0.2, stratified, seed 3)")


def test_val_split_errors_are_one_line(tmp_path):
    from jaxcnn.data.cli import main as data_main
    from jaxcnn.data.images import data_changes
    shapes = _bad_folder(tmp_path / "s")  # train/ and val/
    with pytest.raises(DataError) as err:
        _split(shapes)
    assert str(err.value) == (f"{shapes / 'val'}: a validation split on disk, and data.val_split would make "
                              f"another in code: use one (data.val_split: null validates on {shapes / 'val'}; "
                              f"or move it into {shapes / 'train'})")
    assert data_main(["convert", str(shapes), str(tmp_path / "r"), "--no-progress"]) == 0
    shutil.copytree(shapes / "val", tmp_path / "valonly" / "val")  # not a folder of class folders
    assert data_main(["convert", str(tmp_path / "valonly"), str(tmp_path / "r2"), "--no-progress"]) == 2
    with pytest.raises(DataError, match=r"dataset.json: has a 'val' split, and data.val_split would make "
                                        r"another in code: use one \(data.val_split: null") as err:
        _split(tmp_path / "r", "records")
    singles = _class_folders(tmp_path / "one", [1, 1])
    with pytest.raises(DataError) as err:
        _split(singles)
    assert str(err.value) == (f"{singles}: data.val_split 0.2 leaves no validation images: every class has a "
                              "single image (one needs 2, one for each side)")
    flat = _class_folders(tmp_path / "flat", [2, 3])
    assert data_main(["convert", str(flat), str(tmp_path / "rf"), "--no-progress"]) == 0
    with pytest.raises(DataError, match=r"missing split 'val' \(has \['train'\]\); set data.val_split"):
        _split(tmp_path / "rf", "records", val_split=None)
    with pytest.raises(DataError, match=r"these look like class folders: set data.val_split"):
        _split(flat, val_split=None)
    sidecar = tmp_path / "rf" / "dataset.json"
    meta = json.loads(sidecar.read_text())
    del meta["splits"]["train"]["per_class"]  # converted by an older jaxcnn-data convert
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"does not count the records of each class .* convert the folder again"):
        _split(tmp_path / "rf", "records")
    # a resume compares the split's settings first: one phrase
    a, b = _split(flat).fingerprint(), _split(flat, val_split=0.5).fingerprint()
    assert data_changes(a, b) == ["val_split 0.5 seed 3, the run's had val_split 0.2 seed 3"]
    assert data_changes(a, _split(shapes, val_split=None).fingerprint()) == [
        "no val_split (a val split on disk), the run's had val_split 0.2 seed 3"]


def test_a_folder_of_class_folders_keeps_the_scans_guarantees(tmp_path):
    """One listing: a file linked into a second class is an error naming both (so no file is on
    both sides of the split), and files that are not images are counted as skipped."""
    root = _class_folders(tmp_path / "f", [3, 3])
    os.symlink(root / "c0" / "00.png", root / "c1" / "linked.png")
    with pytest.raises(DataError) as err:
        _split(root)
    assert str(err.value) == (f"{root / 'c1' / 'linked.png'}: the same file as {root / 'c0' / '00.png'} "
                              f"({root / 'c0' / '00.png'}): its images would be in class 'c0' of the image "
                              "folder and in class 'c1' of the image folder")
    (root / "c1" / "linked.png").unlink()
    (root / "c1" / "notes.txt").write_text("x")
    images = _split(root, on_bad_image="skip")
    assert images.skipped_at_open == 1 and len(images.train) + len(images.val) == 6
    assert "1 file left out of" in images.skipped_note()
