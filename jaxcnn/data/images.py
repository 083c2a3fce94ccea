"""An image folder or a record directory as the trainer uses it: ``data.source: folder|records``.

`ImageData` opens both splits (``train`` and ``val``, on disk or, with ``val_split``, held out
of one split in code by `jaxcnn.data.split`), names the classes, and makes the
batch makers the grain `jaxcnn.data.Loader` runs: `TrainBatches` (the `jaxcnn.data.Augment`
steps, by default ImageNet's random-resized crop and flip; the batch for a step a pure function
of the seed and the step) and `EvalBatches` (resize and centre crop, each validation image
once). Images reach the device as ``uint8`` and are normalised there with the ImageNet channel
statistics (`jaxcnn.data.transforms.IMAGENET_MEAN`, `IMAGENET_STD`, the convention of
torchvision's and timm's ImageNet models), which a run's ``preprocessing.json`` records with the
class names.
"""
from __future__ import annotations

import os

from jaxcnn.data.augment import FILE_RECIPE, as_augment
from jaxcnn.data.loader import EvalBatches, TrainBatches
from jaxcnn.data.transforms import default_eval_resize
from jaxcnn.errors import DataError

SOURCES = ("folder", "records")


def missing_packages(source: str, *, loader: bool = True) -> list[str]:
    """The pip packages an image source needs (``pip install -e ".[data]"``) that do not import:
    Pillow, grain for the loader (``loader``), and ArrayRecord for ``records``. Without them the
    first batch ended in a ``ModuleNotFoundError`` traceback."""
    import importlib
    needed = ([("grain", "grain")] if loader else []) + [("PIL", "pillow")]
    needed += [("array_record", "array-record")] if source == "records" else []
    missing = []
    for module, package in needed:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return missing


class ImageData:
    """The two splits of an image folder (``source="folder"``) or a record directory (``"records"``).

    Arguments:
        source: ``"folder"`` or ``"records"``.
        path: the image folder (``PATH/train/<class>/<image>``, ``PATH/val/<class>/<image>``) or
            the directory ``jaxcnn-data convert`` wrote.
        image_size: ``(H, W)`` both transforms produce.
        on_bad_image: ``"skip"`` (count and go on) or ``"fail"``.
        eval_resize: the shorter side before the evaluation centre crop; None:
            `default_eval_resize` (224 -> 256).
        augment: the training images' `jaxcnn.data.Augment` (default ImageNet's); its
            ``interpolation`` is the evaluation resize's too.
        outside_links: a folder: follow links that lead outside it (`jaxcnn.data.folder.Listing`).
        val_split: None (the ``val`` split on disk), or the share of each class to hold out of
            the one split there is (a folder of class folders ``PATH/<class>/<image>``, or
            ``PATH/train`` without ``PATH/val``, or records converted from one) for validation:
            `jaxcnn.data.split.stratified_split`.
        seed: the data seed that chooses the held-out images (with ``val_split``).

    Raises:
        DataError: naming the folder or file (missing split, empty class folder, a ``val``
            split on disk as well as ``val_split``, a side left empty, ...).

    Attributes:
        train, val: the splits' sources; class_names; ``split``: what ``val_split`` held out
            (`split_record`; None without it); ``skipped_at_open``: images left out
            before training (non-image files of a folder, or the converter's skipped images; a
            folder's sub-folders that cannot be listed are named by `skipped_note` too).
    """

    def __init__(self, source: str, path, *, image_size, on_bad_image: str = "fail", eval_resize=None,
                 outside_links: bool = False, val_split: float | None = None, seed: int = 0,
                 augment=FILE_RECIPE):
        if source not in SOURCES:
            raise ValueError(f"image source must be one of {list(SOURCES)}, got {source!r}")
        if val_split is not None and not 0.0 < val_split < 1.0:
            raise ValueError(f"val_split must be in (0, 1) or None, got {val_split!r}")
        self.val_split, self.seed = val_split, int(seed)
        path = os.fspath(path)
        self.source, self.path = source, path
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.on_bad_image = on_bad_image
        self.augment = as_augment(augment)
        self.eval_resize = default_eval_resize(self.image_size) if eval_resize is None else int(eval_resize)
        if self.eval_resize < max(self.image_size):
            raise ValueError(f"eval resize {self.eval_resize} is smaller than the crop {list(self.image_size)}")
        self._outside_links = outside_links
        if source == "folder":
            self.train, self.val, index = _folder_sides(path, on_bad_image, outside_links, val_split, self.seed)
            self.skipped_at_open = sum(len(i.skipped) for i in index)
            self._skipped_names = sum((i.skipped for i in index), ())
            self._unlisted = sum((i.unlisted for i in index), ())
        else:
            self.train, self.val = _record_sides(path, val_split, self.seed)
            self.skipped_at_open = (self.train.source.skipped if val_split is not None
                                    else self.train.skipped + self.val.skipped)
            self._skipped_names = self._unlisted = ()  # named by jaxcnn-data convert when it ran
            if self.train.class_names != self.val.class_names:
                raise DataError(f"{path}: train and val records name different classes")
        self.class_names = tuple(self.train.class_names)
        self.split = None if val_split is None else split_record(self.train, self.val, val_split, self.seed)
        self._fingerprint = None

    def skipped_note(self) -> str | None:
        """One line on the ``skipped_at_open`` images (None when there are none)."""
        n, folders = self.skipped_at_open, len(self._unlisted)
        if not n and not folders:
            return None
        files = f"{n} file{'s' if n != 1 else ''}"
        if self.source == "records":
            return (f"{files} left out of {self.path} by jaxcnn-data convert (not images, or bad ones; "
                    "it named them)")
        what, why = [], []
        if n:
            what.append(files)
            why.append("not images by their names: " + ", ".join(self._skipped_names[:3])
                       + (", ..." if n > 3 else ""))
        if folders:
            what.append(f"{folders} folder{'s' if folders != 1 else ''}")
            why.append("cannot be listed: " + "; ".join(self._unlisted[:3]) + ("; ..." if folders > 3 else ""))
        return f"{' and '.join(what)} left out of {self.path} ({'; '.join(why)}; data.on_bad_image is skip)"

    def fingerprint(self) -> dict:
        """What identifies the data a run trains and evaluates on, cheaply (no image read):
        ``{"source", "path", "classes", "train": {"images", "sha256"}, "val": {...}}``; a run
        records it (``run_meta.json``) and a resume compares it (`data_changes`)."""
        if self._fingerprint is None:
            self._fingerprint = {"source": self.source, "path": os.path.abspath(self.path),
                                 "classes": len(self.class_names), "train": self.train.fingerprint(),
                                 "val": self.val.fingerprint()}
            if self.split is not None:
                self._fingerprint["split"] = self.split
        return dict(self._fingerprint)

    def split_note(self) -> str | None:
        """The start-up line of a ``val_split`` (None without one): ``data: folder PATH, 4
        classes, 900 train / 100 val (val_split 0.1, stratified, seed 0)``, and how many
        classes of a single image have none held out."""
        if self.split is None:
            return None
        single = sum(1 for _, val in self.split["per_class"].values() if val == 0)
        alone = (f"; {single} class{'es' if single != 1 else ''} of one image, kept for training"
                 if single else "")
        return (f"data: {self.source} {self.path}, {self.num_classes} classes, {len(self.train)} train / "
                f"{len(self.val)} val (val_split {self.val_split:g}, stratified, seed {self.seed}{alone})")

    def changes_since_opened(self) -> list[str]:
        """How the data differ now from when they were opened (`data_changes` phrases, or the
        one-line error that opening them now gives; empty: the same). The trainer asks before
        each evaluation: ``jaxcnn-data convert`` run into a record directory again, or images
        added to, removed from or renamed in an image folder's ``val`` split, changed what a
        running trainer evaluated on, silently.

        A record directory is compared as a whole (``dataset.json``; the same folder converted
        again is a change too, as its files were replaced). Of an image folder only
        ``val`` is listed again, which costs less than the evaluation that reads every file of
        it: the training split's file list is fixed when it is opened, and listing it again
        would cost in proportion to it at every evaluation (a file removed from it is a bad
        image when its turn comes). With ``val_split`` an image folder is not listed again: the
        held-out images are fixed when it is opened, as the training split's are (listing
        them anew would list the whole folder). Names are compared, not contents: a file
        rewritten in place under the same name is not seen."""
        try:
            if self.source == "records":
                train, val = _record_sides(self.path, self.val_split, self.seed)
                now = dict(self.fingerprint(), classes=len(train.class_names), train=train.fingerprint(),
                           val=val.fingerprint())
                # The same folder converted again: the same examples, in files that replaced the
                # run's (removed; a worker started now could not open them). A resume takes them.
                rewritten = [f"{split}: converted again ({os.path.basename(new.path)} replaced "
                             f"{os.path.basename(old.path)})"
                             for split, old, new in (("train", self.train, train), ("val", self.val, val))
                             if new.path != old.path]
                return data_changes(self.fingerprint(), now) or rewritten
            elif self.val_split is not None:
                return []  # the held-out list is fixed when opened, as the training split's is
            else:
                from jaxcnn.data.folder import FolderSource, scan_split

                val = FolderSource(scan_split(self.path, "val", self.class_names, on_bad_image=self.on_bad_image,
                                              outside_links=self._outside_links))
                now = dict(self.fingerprint(), val=val.fingerprint())
        except DataError as err:
            return [str(err)]
        return data_changes(self.fingerprint(), now)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple:
        """``(H, W, 3)``."""
        return self.image_size + (3,)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path)) or self.path

    def train_batches(self, *, seed: int, batch_size: int, process_index: int = 0,
                      process_count: int = 1) -> TrainBatches:
        """The training batch maker (``step -> batch``) for this process."""
        return TrainBatches(self.train, seed=seed, batch_size=batch_size, image_size=self.image_size,
                            on_bad_image=self.on_bad_image, process_index=process_index,
                            process_count=process_count, augment=self.augment, resize=self.eval_resize)

    def eval_batches(self, *, batch_size: int, process_index: int = 0, process_count: int = 1) -> EvalBatches:
        """The evaluation batch maker (``batch number -> batch``) over the ``val`` split."""
        return EvalBatches(self.val, batch_size=batch_size, image_size=self.image_size, resize=self.eval_resize,
                           on_bad_image=self.on_bad_image, process_index=process_index,
                           process_count=process_count, interpolation=self.augment.interpolation)


def _folder_sides(path, on_bad_image, outside_links, val_split, seed):
    """``(train, val, indexes)`` of an image folder: `FolderSource` of each side and the
    `FolderIndex` of each scan (one with ``val_split``, which it splits)."""
    from jaxcnn.data.folder import FolderIndex, FolderSource, scan_folder, scan_unsplit
    from jaxcnn.data.split import per_class_counts, stratified_split

    if val_split is None:
        index = scan_folder(path, on_bad_image=on_bad_image, outside_links=outside_links)
        return FolderSource(index["train"]), FolderSource(index["val"]), (index["train"], index["val"])
    whole = scan_unsplit(path, on_bad_image=on_bad_image, outside_links=outside_links)
    counts = per_class_counts(whole.labels, len(whole.class_names))
    sides = [FolderIndex(whole.root, tuple(whole.paths[i] for i in side), tuple(whole.labels[i] for i in side),
                         whole.class_names) for side in stratified_split(counts, val_split, seed)]
    _check_sides(path, val_split, len(sides[0]), len(sides[1]), max(counts))
    return FolderSource(sides[0]), FolderSource(sides[1]), (whole,)


def _record_sides(path, val_split, seed):
    """The ``train`` and ``val`` sources of a record directory, from one reading of its
    ``dataset.json``: both splits of one conversion, or, with ``val_split``, the two sides of
    its one split (`jaxcnn.data.split.Subset`)."""
    from jaxcnn.data.records import SIDECAR, RecordSource, read_sidecar
    from jaxcnn.data.split import Subset, stratified_split

    meta = read_sidecar(path)
    sidecar = os.path.join(os.fspath(path), SIDECAR)
    if val_split is None:
        if "val" not in meta["splits"] and "train" in meta["splits"]:
            raise DataError(f"{sidecar}: missing split 'val' (has {sorted(meta['splits'])}); set "
                            "data.val_split (e.g. 0.1) to hold out a share of each class of train in code")
        return RecordSource(path, "train", meta), RecordSource(path, "val", meta)
    if "val" in meta["splits"]:
        raise DataError(f"{sidecar}: has a 'val' split, and data.val_split would make another in code: "
                        "use one (data.val_split: null validates on the val records; or convert the folder "
                        "without its val/)")
    whole = RecordSource(path, "train", meta)
    if whole.per_class is None:
        raise DataError(f"{sidecar}: does not count the records of each class (converted by an older "
                        "jaxcnn-data convert), which data.val_split needs: convert the folder again")
    train, val = stratified_split(whole.per_class, val_split, seed)
    _check_sides(path, val_split, len(train), len(val), max(whole.per_class, default=0))
    return Subset(whole, train, "train"), Subset(whole, val, "val")


def _check_sides(path, val_split, train: int, val: int, largest_class: int) -> None:
    """A :class:`DataError` when ``val_split`` leaves a side empty."""
    if not train or not val:
        why = ("every class has a single image (one needs 2, one for each side)" if largest_class == 1
               else "there are no images")
        raise DataError(f"{path}: data.val_split {val_split:g} leaves {'no' if train else 'no training'} "
                        f"{'validation ' if train else ''}images: {why}")


def split_record(train, val, val_split: float, seed: int) -> dict:
    """What a ``val_split`` held out, as ``run_meta.json`` records it (in the data fingerprint):
    ``{"val_split", "seed", "stratified": True, "per_class": {class: [train, val]}, "val_sha256"}``,
    ``val_sha256`` being the held-out side's fingerprint hash (a folder's: SHA-256 over the
    class names, each NUL-terminated, a NUL, and each held-out ``<class>/<file>``
    NUL-terminated, in order; records': `jaxcnn.data.split.Subset.fingerprint`)."""
    import numpy as np

    def counts(side):
        labels = side.index.labels if hasattr(side, "index") else np.repeat(
            np.arange(len(side.class_names)), side.source.per_class)[side.indices]
        return np.bincount(np.asarray(labels, np.int64), minlength=len(side.class_names)).tolist()

    per_class = {name: [t, v] for name, t, v in zip(train.class_names, counts(train), counts(val))}
    return {"val_split": val_split, "seed": seed, "stratified": True, "per_class": per_class,
            "val_sha256": val.fingerprint()["sha256"]}


def data_changes(saved: dict, now: dict) -> list[str]:
    """How the data a run recorded (`ImageData.fingerprint`) differ from ``now``'s, one phrase
    per split that changed (empty: the same, or nothing comparable recorded)."""
    if not isinstance(saved, dict) or saved.get("source") != now.get("source"):
        return []
    was, held = _split_settings(saved.get("split")), _split_settings(now.get("split"))
    if was != held:  # other sides follow from it: the one phrase
        return [f"{held}, the run's had {was}"]
    changes = []
    if saved.get("classes") != now["classes"]:
        changes.append(f"{now['classes']} classes, the run's had {saved.get('classes')}")
    for split in ("train", "val"):
        old, new = saved.get(split), now[split]
        if not isinstance(old, dict) or old == new:
            continue
        if old.get("images") != new["images"]:
            changes.append(f"{split}: {new['images']} images, the run's had {old.get('images')}")
        else:
            what = "other file names" if now["source"] == "folder" else "other records"
            changes.append(f"{split}: {new['images']} images as before, but {what}")
    return changes


def _split_settings(split) -> str:
    """``"val_split 0.1 seed 0"`` of a fingerprint's ``split`` record; for none, the run's ``val`` split."""
    if not isinstance(split, dict):
        return "no val_split (a val split on disk)"
    return f"val_split {split.get('val_split')} seed {split.get('seed')}"
