"""Image folders in torchvision's ``ImageFolder`` layout: ``ROOT/<split>/<class>/<image>``.

Classes are indexed by their folder names in sorted order (as ``ImageFolder`` does); the
examples of a split are ordered by ``(class, file name)``, so example ``i`` is the same file
on every host and in every run. A folder of class folders only, ``ROOT/<class>/<image>`` (or
``ROOT/train`` without ``ROOT/val``), is listed whole by :func:`scan_unsplit` for a validation
split made in code (`jaxcnn.data.split`). Scanning the folder only lists file names (1.28 million
ImageNet files take seconds); an image is read and decoded when a batch needs it, and a bad
one (unreadable, not an image, corrupt or truncated) raises :class:`BadImageError` naming the
file, which the loader counts and skips or stops on (``data.on_bad_image``).

Decoding is Pillow's, fully (``Image.load()``, so a truncated JPEG fails here rather than
decoding into grey rows), turned upright as its EXIF orientation says (a phone's photo is
seen as its owner sees it), and every mode Pillow reads (grey, grey+alpha, palette, CMYK,
RGBA, 16-bit) is converted to 8-bit RGB; alpha is dropped, as ``ImageFolder``'s default
loader does. :func:`decode_image` is the one decode of training, evaluation, record
conversion and ``jaxcnn-predict``.
"""
from __future__ import annotations

import hashlib
import io
import os
import stat
import warnings
from typing import NamedTuple

from jaxcnn.errors import BadImageError, DataError

# What ImageFolder's default loader accepts, less the formats Pillow may not read everywhere.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
SPLITS = ("train", "val")
# Files and folders that operating systems, archivers and NAS boxes leave in folders of photos,
# compared without case: never images, never classes, skipped like hidden (dot) files, which
# cover macOS's .DS_Store, ._<name> and .Spotlight-V100. Windows: thumbnail caches, folder
# settings, the recycle bin; macOS: a folder's custom icon ("Icon\r"), a zip's __MACOSX/;
# Synology: @eaDir/ thumbnails; ext4: lost+found/ at a file system's root.
OS_METADATA_FILES = frozenset({"thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini", "icon\r"})
OS_METADATA_DIRS = frozenset({"__macosx", "@eadir", "$recycle.bin", "system volume information", "lost+found"})
# An image larger than this many pixels is refused before it is decoded (a decompression bomb
# would otherwise take the memory of the worker): 8K x 8K, far beyond any training photo.
MAX_PIXELS = 1 << 26
# Refuse to read more bytes than this for one image (a FIFO or /dev/zero named like an image).
MAX_FILE_BYTES = 256 << 20


class FolderIndex(NamedTuple):
    """The file list of one split of an image folder.

    Fields:
        root: the split directory, ``ROOT/<split>``.
        paths: file paths relative to ``root`` (``"<class>/<file>"``), ordered by class then name.
        labels: class index of each file.
        class_names: the sorted class folder names.
        skipped: files left out because their names are not images' (``on_bad_image="skip"``).
        unlisted: ``"<folder>: cannot list (<why>)"`` for each folder left out because it could
            not be listed (``on_bad_image="skip"``).
    """

    root: str
    paths: tuple
    labels: tuple
    class_names: tuple
    skipped: tuple = ()
    unlisted: tuple = ()

    def __len__(self):
        return len(self.paths)


def is_os_metadata(name: str, *, folder: bool) -> bool:
    """Whether a file (``folder=False``) or folder name is one an OS or tool leaves behind, not
    data: hidden (a leading dot) or one of `OS_METADATA_FILES` / `OS_METADATA_DIRS`."""
    return name.startswith(".") or name.lower() in (OS_METADATA_DIRS if folder else OS_METADATA_FILES)


def is_image_name(name: str) -> bool:
    """Whether a file name has one of the `IMAGE_EXTENSIONS` (any case)."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def split_dir(root, split: str) -> str:
    """``ROOT/<split>``, checked to be a directory; a missing one is a :class:`DataError`."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise DataError(f"{root}: image folder does not exist or is not a directory")
    path = os.path.join(root, split)
    if not os.path.isdir(path):
        have = sorted(d for d in os.listdir(root)
                      if os.path.isdir(os.path.join(root, d)) and not is_os_metadata(d, folder=True))
        hint = ""
        if have and all(_holds_images(os.path.join(root, d)) for d in have):
            name, parent = os.path.basename(os.path.normpath(root)), os.path.dirname(os.path.normpath(root))
            if name in SPLITS and os.path.isdir(os.path.join(parent, split)):
                hint = f"; {root} is itself a split: the image folder is {parent or '.'}"
            else:  # ImageFolder's own layout, ROOT/<class>/<image>, has no split folders
                hint = (f"; these look like class folders: set data.val_split (e.g. 0.1) to hold out a "
                        f"share of each class in code, or put them under {os.path.join(root, 'train')} "
                        f"and a validation share of each class under {os.path.join(root, 'val')}")
        elif split == "val" and "train" in have:
            hint = "; or set data.val_split (e.g. 0.1) to hold out a share of each class of train in code"
        raise DataError(f"{path}: missing split {split!r} (an image folder holds {root}/train/<class>/<image> "
                        f"and {root}/val/<class>/<image>; found folders {have[:20]}{hint})")
    return path


def _holds_images(folder: str) -> bool:
    """Whether ``folder`` has an image file directly in it (a class folder)."""
    try:
        with os.scandir(folder) as entries:
            return any(e.is_file() and is_image_name(e.name) for e in entries)
    except OSError:
        return False


def scan_split(root, split: str, class_names=None, *, on_bad_image: str = "fail",
               outside_links: bool = False, listing: "Listing | None" = None) -> FolderIndex:
    """Lists the images of ``ROOT/<split>``.

    Arguments:
        root: the image folder.
        split: ``"train"`` or ``"val"`` (any sub-folder name).
        class_names: the classes to expect (the training split's); None takes this split's
            folders. A validation split must have the same class folders as the training split.
        on_bad_image: ``"fail"``: a file whose name is not an image's, or a folder that cannot
            be listed, is an error; ``"skip"``: it is left out and named in ``skipped``.
        outside_links: follow links (to folders or files) that lead outside ``root``; without
            it such a link is an error naming it (a ``listing`` given keeps its own setting).
        listing: what earlier splits of the same scan listed (:func:`scan_folder` passes one),
            so that no file lands in both splits.

    Returns:
        A `FolderIndex`.

    Raises:
        DataError naming the folder or file: a missing split, no class folders, a class folder
        with no images, a file that is not an image by its extension (with ``on_bad_image="fail"``;
        hidden files such as ``.DS_Store`` and the other names of `OS_METADATA_FILES` and
        `OS_METADATA_DIRS`, e.g. ``Thumbs.db``, ``desktop.ini``, ``__MACOSX/``, are ignored),
        class folders that differ from ``train``'s, a folder that cannot be listed, a link out
        of ``root``, a file or folder reached in two classes or in both splits.
    """
    path = split_dir(root, split)
    listing = Listing(root, outside_links) if listing is None else listing
    return _scan_classes(path, split, class_names, on_bad_image, listing)


def scan_unsplit(root, *, on_bad_image: str = "fail", outside_links: bool = False) -> FolderIndex:
    """Lists every image of an image folder whose validation split is made in code
    (``data.val_split``, `jaxcnn.data.split`): ``ROOT/train/<class>/<image>`` when ``ROOT``
    has a ``train`` folder, else ``ROOT/<class>/<image>`` (torchvision's ``ImageFolder``
    layout; classes named ``train`` or ``val`` are read as splits). The same guarantees as
    :func:`scan_split` (one `Listing`, links followed once, a file reached in two classes
    is an error).

    Raises:
        DataError naming the folder: as :func:`scan_split`, and a ``ROOT/val`` folder (a
        validation split on disk already: one or the other).
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise DataError(f"{root}: image folder does not exist or is not a directory")
    val = os.path.join(root, "val")
    if os.path.isdir(val):
        raise DataError(f"{val}: a validation split on disk, and data.val_split would make another in "
                        f"code: use one (data.val_split: null validates on {val}; or move it into "
                        f"{os.path.join(root, 'train')})")
    if os.path.isdir(os.path.join(root, "train")):
        return scan_split(root, "train", on_bad_image=on_bad_image, outside_links=outside_links)
    return _scan_classes(root, "", None, on_bad_image, Listing(root, outside_links))


def _scan_classes(path: str, split: str, class_names, on_bad_image: str, listing: "Listing") -> FolderIndex:
    """:func:`scan_split`'s listing of the class folders under ``path`` (``split``: the name
    the scan's errors give it; empty for an image folder of class folders only)."""
    classes = _class_folders(path, class_names)
    if on_bad_image not in ("skip", "fail"):
        raise ValueError(f"on_bad_image must be 'skip' or 'fail', got {on_bad_image!r}")
    listing.claim_dir(path, os.path.realpath(path), (split, None), os.path.islink(path))
    paths, labels, skipped, unlisted = [], [], [], []
    for label, name in enumerate(classes):
        files = _class_files(path, name, (split, name), listing, on_bad_image, (skipped, unlisted))
        paths.extend(sorted(files))
        labels.extend([label] * len(files))
    return FolderIndex(path, tuple(paths), tuple(labels), tuple(classes), tuple(skipped), tuple(unlisted))


def _class_folders(path: str, class_names) -> list:
    """The class folder names of the split folder ``path``, checked against ``class_names``."""
    try:
        entries = sorted(os.listdir(path))
    except OSError as err:
        raise DataError(f"{path}: cannot list ({err.strerror or err})") from None
    dirs = {e for e in entries if os.path.isdir(os.path.join(path, e))}
    classes = [e for e in entries if e in dirs and not is_os_metadata(e, folder=True)]
    stray = [e for e in entries if e not in dirs and not is_os_metadata(e, folder=False)]
    if stray:
        raise DataError(f"{os.path.join(path, stray[0])}: not a class folder (every entry of {path} "
                        f"must be a folder of images)")
    if not classes:
        raise DataError(f"{path}: no class folders (expected {path}/<class>/<image>)")
    if class_names is not None and list(class_names) != classes:
        missing = sorted(set(class_names) - set(classes))
        extra = sorted(set(classes) - set(class_names))
        raise DataError(f"{path}: class folders differ from the training split's "
                        f"(missing {missing[:5]}, extra {extra[:5]})")
    return classes


class Listing:
    """What one scan of an image folder has listed, by real path, and for which split and class:
    every folder and file once. Links are followed (as ``ImageFolder`` does), but a link that
    leads back into what the scan listed for another class or split (a loop up to the split
    folder pulled every class into one, and ``val`` into ``train``) is an error, one into the
    same class is left out (its files are listed already), and one that leads outside the
    image folder is an error unless ``outside_links`` (a class folder linked to ``/`` walked
    the whole file system)."""

    def __init__(self, root, outside_links: bool = False):
        self.root = os.path.realpath(os.fspath(root))
        self.outside_links = bool(outside_links)
        self._owner = {}  # real path -> ((split, class or None), path as shown, reached by a link)

    def _where(self, owner) -> str:
        split, name = owner
        of_split = f"split {split!r}" if split else "the image folder"
        return of_split if name is None else f"class {name!r} of {of_split}"

    def _claim(self, shown: str, real: str, owner, kind: str, linked: bool) -> bool:
        if not self.outside_links and os.path.commonpath([self.root, real]) != self.root:
            raise DataError(f"{shown}: a link to {real}, outside the image folder {self.root} "
                            f"(set data.outside_links: true, or jaxcnn-data convert --outside-links, "
                            f"to follow it)")
        earlier = self._owner.get(real)
        if earlier is None:
            self._owner[real] = (owner, shown, linked)
            return True
        if earlier[0] == owner:
            return False  # a second way into this class's own files: listed once
        # name the link first, whichever way the scan came to it first
        first, second = (earlier[1], shown) if earlier[2] and not linked else (shown, earlier[1])
        raise DataError(f"{first}: the same {kind} as {second} ({real}): its images would be in "
                        f"{self._where(earlier[0])} and in {self._where(owner)}")

    def claim_dir(self, shown: str, real: str, owner, linked: bool) -> bool:
        """Whether to walk the folder ``shown`` (real path ``real``, reached through a link or
        not) for ``owner``."""
        return self._claim(shown, real, owner, "folder", linked)

    def claim_file(self, shown: str, real: str, owner, linked: bool) -> bool:
        """Whether to list the file ``shown`` for ``owner``."""
        return self._claim(shown, real, owner, "file", linked)


def _class_files(path, name, owner, listing: Listing, on_bad_image: str, left_out) -> list:
    """The image files under the class folder ``path/name``, relative to ``path``. Under
    ``on_bad_image="skip"`` the non-image files and the folders that cannot be listed are
    appended to ``left_out = (skipped, unlisted)``."""
    skipped, unlisted = left_out
    folder = os.path.join(path, name)
    real_folder = os.path.realpath(folder)
    files, stack = [], [(folder, real_folder)]
    listing.claim_dir(folder, real_folder, owner, os.path.islink(folder))
    while stack:
        directory, real_dir = stack.pop()  # its real path as claimed: not resolved again
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as err:
            problem = f"{directory}: cannot list ({err.strerror or err})"
            if on_bad_image == "skip" and directory != folder:  # a class's own folder: always
                unlisted.append(problem)
                continue
            raise DataError(problem + "; fix its permissions, or set data.on_bad_image: skip") from None
        subdirs = []
        for entry in entries:
            shown = os.path.join(directory, entry.name)
            if entry.is_dir():
                real = os.path.realpath(shown) if entry.is_symlink() else os.path.join(real_dir, entry.name)
                if not is_os_metadata(entry.name, folder=True) and listing.claim_dir(
                        shown, real, owner, entry.is_symlink()):
                    subdirs.append((shown, real))
                continue
            if is_os_metadata(entry.name, folder=False):
                continue
            if not is_image_name(entry.name):
                if on_bad_image == "skip":
                    skipped.append(shown)
                    continue
                raise DataError(f"{shown}: not an image file (extensions {', '.join(IMAGE_EXTENSIONS)}); "
                                f"remove it, or set data.on_bad_image: skip")
            real = os.path.realpath(shown) if entry.is_symlink() else os.path.join(real_dir, entry.name)
            if listing.claim_file(shown, real, owner, entry.is_symlink()):
                files.append(os.path.relpath(shown, path))
        stack.extend(reversed(subdirs))
    if not files:
        raise DataError(f"{folder}: empty class folder (no images)")
    return files


def scan_folder(root, splits=SPLITS, *, on_bad_image: str = "fail", outside_links: bool = False) -> dict:
    """``{split: FolderIndex}`` for ``splits`` of an image folder, the classes taken from the first;
    no file or folder is listed in two classes or in two splits (see :class:`Listing`)."""
    out = {}
    names = None
    listing = Listing(root, outside_links)
    for split in splits:
        out[split] = scan_split(root, split, names, on_bad_image=on_bad_image, listing=listing)
        names = out[split].class_names
    return out


def read_file(path: str) -> bytes:
    """The bytes of one image file; any problem is a :class:`BadImageError` naming it."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # before open: opening a FIFO would block
            raise BadImageError(f"{path}: not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise BadImageError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not read as an image")
        with open(path, "rb", buffering=0) as f:
            # Sized by the file, not by the limit: read(n) allocates n bytes up front.
            data = f.read(info.st_size + 1)
    except OSError as err:
        raise BadImageError(f"{path}: unreadable ({err.strerror or err})") from None
    if len(data) > MAX_FILE_BYTES:
        raise BadImageError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not read as an image")
    if not data:
        raise BadImageError(f"{path}: empty file")
    return data


def decode_image(data: bytes, name: str):
    """Decodes encoded image bytes to an upright 8-bit RGB ``PIL.Image`` (fully loaded).

    Arguments:
        data: the file's bytes.
        name: what names the image in an error (its path, or ``records:index``).

    Raises:
        BadImageError naming ``name``: not an image, corrupt, truncated, or too large.
    """
    Image = _pil()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # kept, and said once per file below
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height == 0:
                raise BadImageError(f"{name}: an empty ({width}x{height}) image")
            if width * height > MAX_PIXELS:
                raise BadImageError(f"{name}: {width}x{height} pixels is more than the "
                                    f"{MAX_PIXELS}-pixel limit")
            image.load()  # decode everything now: a truncated file fails here
            image = as_upright_rgb(image)
    except BadImageError:
        raise
    except Image.UnidentifiedImageError:
        raise BadImageError(f"{name}: not an image (Pillow cannot identify it)") from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError,
            Image.DecompressionBombWarning, MemoryError) as err:
        raise BadImageError(f"{name}: corrupt or truncated image ({type(err).__name__}: {err})") from None
    _warn_once(name, caught)
    return image


_WARNED = set()


def _warn_once(name: str, caught) -> None:
    """Pillow's warnings about an image (corrupt EXIF data, ...), each said once per file and
    process, naming the file: the filters that make a decompression bomb an error are set per
    call, and each such call made Python forget the warnings it had shown, so a run said the
    same warning at every epoch."""
    for w in caught:
        key = (name, str(w.message))
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"{name}: {w.message}", w.category, stacklevel=3)


_PIL_IMAGE = None


def _pil():
    global _PIL_IMAGE
    if _PIL_IMAGE is None:  # imported on first use, once: decode_image runs for every image
        from PIL import Image

        _PIL_IMAGE = Image
    return _PIL_IMAGE


# The EXIF tag that says how the camera was held (1: as stored; 2-8: mirrored and/or turned).
_ORIENTATION = 0x0112


def as_upright_rgb(image):
    """An 8-bit RGB ``PIL.Image`` of a decoded ``image``: turned as its EXIF orientation says
    (the tag is then removed, so a second call turns nothing) and converted by
    :func:`_to_rgb`. ``image`` itself when it is upright RGB already."""
    if image.getexif().get(_ORIENTATION, 1) in range(2, 9):
        from PIL import ImageOps

        image = ImageOps.exif_transpose(image)
    return image if image.mode == "RGB" else _to_rgb(image)


def _to_rgb(image):
    """8-bit RGB from any Pillow mode: 16/32-bit grey is scaled to 8 bits, alpha dropped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        import numpy as np
        from PIL import Image

        values = np.asarray(image, np.float64)
        peak = 65535.0 if image.mode.startswith("I;16") else max(float(values.max()), 1.0)
        grey = np.clip(np.rint(values * (255.0 / peak)), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert("RGB")


def class_names_digest(class_names):
    """A SHA-256 that has read ``class_names``, each NUL-terminated (names that are not valid
    UTF-8 as the file system gave them): where the fingerprints of a folder's split
    (:meth:`FolderSource.fingerprint`) and of its converted records
    (``RecordSource.fingerprint``) start."""
    digest = hashlib.sha256()
    for name in class_names:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
    return digest


class FolderSource:
    """Random access to the encoded images of one split of an image folder.

    ``source[i]`` is ``(encoded bytes, label, name)``; reading a file that cannot be read is a
    :class:`BadImageError`. Holds only the file list, so it pickles small into loader workers.
    """

    def __init__(self, index: FolderIndex):
        self.index = index
        self.class_names = index.class_names

    def __len__(self):
        return len(self.index.paths)

    def __getitem__(self, i: int):
        path = os.path.join(self.index.root, self.index.paths[i])
        return read_file(path), int(self.index.labels[i]), path

    @property
    def name(self) -> str:
        return self.index.root

    def fingerprint(self) -> dict:
        """What identifies this split's examples, cheaply (from the file list the scan already
        made, no file opened): ``{"images": N, "sha256": ...}`` over the class names and the
        sorted relative paths, so an added, removed or renamed image or class changes it."""
        digest = class_names_digest(self.index.class_names)
        digest.update(b"\0")
        for path in self.index.paths:
            digest.update(path.encode("utf-8", "surrogateescape") + b"\0")
        return {"images": len(self.index.paths), "sha256": digest.hexdigest()}
