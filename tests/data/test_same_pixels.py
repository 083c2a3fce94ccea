"""The same pixels everywhere: an image file becomes the same ``uint8`` array in evaluation on
the folder, in evaluation on its converted records, in ``jaxcnn-predict`` given its path and
given it opened by Pillow, whatever kind of image it is (EXIF-rotated, 16- and 32-bit grey,
palette with transparency, grey+alpha, CMYK, already at the model's size, odd sizes).

Before one decode served them all, ``jaxcnn-predict`` turned phone photos upright and training
did not (a model at 100% in evaluation scored 0/20 in predict), clipped 16-bit images that
training scaled, and skipped the resize of images already at the model's size."""
import io

import numpy as np
import pytest
from PIL import Image

from jaxcnn.data.cli import main as data_main
from jaxcnn.data.folder import FolderSource, decode_image, scan_folder
from jaxcnn.data.loader import EvalBatches
from jaxcnn.data.records import RecordSource
from jaxcnn.predict import Resize
from jaxcnn.predict import decode_image as predict_decode
from jaxcnn.predict import to_pixels

SIZE = (24, 24)
RESIZE = 27  # evaluation's shorter side: 24 / 0.875 rounded down
_ORIENTATION = 0x0112


def _base(h=30, w=44, seed=0):
    """A smooth RGB picture with a full-range grey (0 and 255 both present)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([xx * 255 // (w - 1), yy * 255 // (h - 1), (xx + yy) * 255 // (h + w - 2)], -1)
    rgb = np.clip(rgb + rng.integers(-20, 21, rgb.shape), 0, 255).astype(np.uint8)
    rgb[0, 0], rgb[-1, -1] = 0, 255
    return rgb


def _exif(orientation):
    exif = Image.Exif()
    exif[_ORIENTATION] = orientation
    return exif


def _write_kinds(folder):
    """Every kind of image file, by name; returns ``{name: what it should decode to or None}``."""
    base = Image.fromarray(_base())
    grey = base.convert("L")
    expected = {}
    # Stored turned a quarter left, with Orientation 6 ("turn right to view"): upright = base.
    base.transpose(Image.Transpose.ROTATE_90).save(folder / "exif6.png", exif=_exif(6))
    expected["exif6.png"] = np.asarray(base)
    base.transpose(Image.Transpose.ROTATE_90).save(folder / "phone.jpg", exif=_exif(6), quality=90)
    expected["phone.jpg"] = None  # lossy: compared with the JPEG's own pixels, turned
    # 16-bit grey at full scale (v * 257) is the 8-bit grey again; 32-bit grey scales to its peak.
    Image.fromarray(np.asarray(grey).astype(np.uint16) * 257).save(folder / "grey16.png")
    expected["grey16.png"] = np.asarray(grey.convert("RGB"))
    Image.fromarray(np.asarray(grey).astype(np.int32) * 1000, mode="I").save(folder / "grey32.tif")
    expected["grey32.tif"] = np.asarray(grey.convert("RGB"))
    palette = base.quantize(16)
    palette.info["transparency"] = 0
    palette.save(folder / "palette.png", transparency=0)
    expected["palette.png"] = None
    grey.convert("LA").save(folder / "grey_alpha.png")
    expected["grey_alpha.png"] = np.asarray(grey.convert("RGB"))
    base.convert("CMYK").save(folder / "cmyk.jpg", quality=95)
    expected["cmyk.jpg"] = None
    Image.fromarray(_base(*SIZE, seed=1)).save(folder / "model_size.png")
    expected["model_size.png"] = _base(*SIZE, seed=1)
    Image.fromarray(_base(50, 31, seed=2)).save(folder / "tall_odd.png")
    expected["tall_odd.png"] = _base(50, 31, seed=2)
    return expected


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
    expected = _write_kinds(root / "val" / "a")
    Image.fromarray(_base(seed=3)).save(root / "train" / "a" / "one.png")
    records = tmp_path_factory.mktemp("kinds_records")
    assert data_main(["convert", str(root), str(records), "--no-progress"]) == 0
    return root, records, expected


def _eval_pixels(source):
    batches = EvalBatches(source, batch_size=len(source), image_size=SIZE, resize=RESIZE)
    batch = batches(0)
    assert batch["mask"].all()
    return batch["image"]


def test_every_kind_of_image_decodes_as_it_should(kinds):
    root, _, expected = kinds
    folder = root / "val" / "a"
    for name, want in expected.items():
        got = decode_image((folder / name).read_bytes(), name)
        assert got.mode == "RGB", name
        if want is not None:
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    with Image.open(folder / "phone.jpg") as stored:
        assert stored.getexif()[_ORIENTATION] == 6
        turned = stored.convert("RGB").transpose(Image.Transpose.ROTATE_270)
    np.testing.assert_array_equal(np.asarray(decode_image((folder / "phone.jpg").read_bytes(), "p")),
                                  np.asarray(turned))


def test_evaluation_records_and_predict_see_the_same_pixels(kinds):
    root, records, expected = kinds
    index = scan_folder(root)["val"]
    assert sorted(index.paths) == sorted(f"a/{name}" for name in expected)
    from_folder = _eval_pixels(FolderSource(index))
    from_records = _eval_pixels(RecordSource(records, "val"))
    np.testing.assert_array_equal(from_records, from_folder)
    for k, path in enumerate(index.paths):
        file = root / "val" / path
        by_path = to_pixels(predict_decode(str(file)), SIZE + (3,), Resize(RESIZE))
        np.testing.assert_array_equal(by_path, from_folder[k], err_msg=path)
        with Image.open(file) as opened:  # Pillow leaves the EXIF turn to its user
            by_image = to_pixels(predict_decode(opened), SIZE + (3,), Resize(RESIZE))
        np.testing.assert_array_equal(by_image, from_folder[k], err_msg=path)


def test_an_image_at_the_models_size_is_resized_and_cropped_as_evaluation_does_it():
    """A 24x24 image under a 27-pixel evaluation resize is scaled up to 27x27 and its centre
    cropped, in evaluation and in predict alike (predict used to pass it through untouched)."""
    pixels = _base(*SIZE, seed=1)
    image = Image.fromarray(pixels)
    got = to_pixels(image, SIZE + (3,), Resize(RESIZE))
    want = np.asarray(image.resize((RESIZE, RESIZE), Image.BILINEAR))[2:26, 2:26]
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, pixels)


def test_an_exif_turn_is_applied_once():
    """Decoding an image Pillow has already turned upright (the tag removed) turns nothing more."""
    buffer = io.BytesIO()
    Image.fromarray(_base()).transpose(Image.Transpose.ROTATE_90).save(buffer, "PNG", exif=_exif(6))
    once = decode_image(buffer.getvalue(), "x")
    np.testing.assert_array_equal(np.asarray(predict_decode(once)), np.asarray(once))


def test_an_empty_image_is_a_bad_image():
    """A 0x0 image given to ``jaxcnn.predict`` raised ZeroDivisionError in the resize."""
    from jaxcnn.errors import PredictError
    with pytest.raises(PredictError, match=r"<image 0>: an empty \(0x0\) image"):
        predict_decode(Image.new("RGB", (0, 0)), "<image 0>")
    with pytest.raises(PredictError, match=r"<image 1>: an empty \(0x3\) image"):
        predict_decode(np.zeros((3, 0, 3), np.uint8), "<image 1>")
