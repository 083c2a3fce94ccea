"""``jaxcnn-data``: image-folder tools.

``jaxcnn-data convert ROOT OUT`` writes the ``train`` and ``val`` splits of an image folder
(``ROOT/<split>/<class>/<image>``; a folder of class folders only is one split, ``train``, that
``data.val_split`` splits in code) to ArrayRecord files in ``OUT`` with a progress bar,
decoding every image once to check it: a bad one is left out and listed
(``--on-bad-image skip``, the default) or stops the conversion (``fail``). Bad input is one
line on stderr and exit status 2. ``jaxcnn-data shapes OUT`` writes a small example folder of
coloured shapes (`jaxcnn.data.shapes`), ``jaxcnn-data digits OUT`` one of coloured handwritten
digits in class folders (`jaxcnn.data.digits`).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import secrets
import sys

from jaxcnn._cli import OneLineParser, path_arg
from jaxcnn.errors import DataError


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {text!r}")
    return value


# jaxcnn-data shapes writes an example folder: --train 999999999999 filled the disk (9 GB in ten
# minutes) before anything said no.
MAX_SHAPES_PER_CLASS = 10_000


def _per_class(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SHAPES_PER_CLASS:
        raise argparse.ArgumentTypeError(f"expected images per class from 1 to {MAX_SHAPES_PER_CLASS:,} "
                                         f"(an example folder), got {text!r}")
    return value


def _parser():
    parser = OneLineParser(prog="jaxcnn-data",
                           description="Image-folder tools: convert an image folder to ArrayRecord "
                                       "files, or write a small example folder of coloured shapes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{convert,shapes,digits}",
                                parser_class=OneLineParser)
    convert = sub.add_parser("convert", help="write an image folder's splits as ArrayRecord files",
                             description="Write the splits of an image folder to ArrayRecord files (each "
                                         "record checksummed) to train from with data.source: records, "
                                         "decoding every image once to check it.")
    convert.add_argument("root", type=path_arg,
                         help="image folder: ROOT/train/<class>/<image> and ROOT/val/<class>/<image>, or "
                              "ROOT/<class>/<image> (converted as one split, train, for data.val_split)")
    convert.add_argument("out", type=path_arg,
                         help="directory for <split>-<token>.array_record and dataset.json (created; not inside ROOT)")
    convert.add_argument("--splits", default=None,
                         help="comma-separated splits to convert, keeping the others OUT holds (default: "
                              "train and val, or train alone when ROOT has no val/ or holds only class folders)")
    convert.add_argument("--on-bad-image", choices=("skip", "fail"), default="skip",
                         help="a file that does not decode: leave it out (skip) or stop (fail)")
    convert.add_argument("--workers", type=_count, default=0,
                         help="processes that read and check images (default 0: this one)")
    convert.add_argument("--outside-links", action="store_true",
                         help="follow links that lead outside ROOT (default: such a link is an error)")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    shapes = sub.add_parser("shapes", help="write a small image folder of coloured shapes (an example)",
                            description="Write a small image folder of coloured shapes (4 classes) that "
                                        "configs/shapes_folder.yaml learns in minutes on a CPU.")
    shapes.add_argument("out", type=path_arg, help="the image folder to write")
    shapes.add_argument("--train", type=_per_class, default=200,
                        help=f"training images per class (default 200, at most {MAX_SHAPES_PER_CLASS:,})")
    shapes.add_argument("--val", type=_per_class, default=50,
                        help=f"validation images per class (default 50, at most {MAX_SHAPES_PER_CLASS:,})")
    shapes.add_argument("--seed", type=_count, default=0, help="seed of the shapes, sizes and colours (default 0)")
    digits = sub.add_parser("digits", help="write an image folder of coloured handwritten digits (an example)",
                            description="Write OUT/<digit>/<n>.{png,jpg}: MNIST digits of the packaged sample "
                                        "in random colours, 20-71 pixels a side, class folders only (train with "
                                        "data.val_split), for a task that must not be mirrored or cropped hard.")
    digits.add_argument("out", type=path_arg, help="the image folder to write")
    digits.add_argument("--digits", type=_digit_list, default=(0, 1, 2, 3),
                        help="comma-separated classes (default 0,1,2,3)")
    digits.add_argument("--per-class", type=_per_class, default=200,
                        help="images per digit (default 200; the packaged sample has 690 to 902 of each)")
    digits.add_argument("--seed", type=_count, default=0, help="seed of the colours and sizes (default 0)")
    return parser


def _progress_bar(total, desc, enabled):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="img", file=sys.stderr)


def convert(root, out, *, splits=None, on_bad_image="skip", workers=0, progress=True,
            say=print, outside_links=False) -> dict:
    """Writes ``splits`` of the image folder ``root`` to ``out``; returns the sidecar's ``splits``.

    ``splits=None`` converts what the folder holds: ``train`` and ``val``, or ``train`` alone
    when it has no ``val`` folder, or, for a folder of class folders only (``ROOT/<class>/
    <image>``), all its images as the one split ``train`` (`jaxcnn.data.folder.scan_unsplit`);
    ``data.val_split`` then holds out validation records in code. Given ``splits`` (``--splits``)
    are converted and the other splits an earlier conversion wrote to ``out`` are kept; with
    ``None`` the new sidecar names only the splits converted.

    The records go to files of new names (`jaxcnn.data.records.record_file`); ``dataset.json``,
    renamed into place last, switches readers to them, and the record files it no longer names
    are then removed (`_remove_replaced`). A conversion that fails removes the files it wrote
    and leaves ``out`` as it was; one conversion at a time writes into ``out`` (a ``flock`` on
    it)."""
    from jaxcnn.data.folder import SPLITS, scan_folder, scan_unsplit

    if workers < 0:
        raise ValueError(f"--workers must be non-negative, got {workers}")
    most = max(16, 4 * (os.cpu_count() or 1))  # as the trainer bounds data.workers: each is a process
    if workers > most:
        raise ValueError(f"--workers {workers} is more than {most} processes (4 per core of this "
                         f"machine's {os.cpu_count()}, at least 16)")
    # every split is scanned before anything is written
    if splits is None and os.path.isdir(root) and not any(os.path.isdir(os.path.join(root, s)) for s in SPLITS):
        indexes = {"train": scan_unsplit(root, on_bad_image=on_bad_image, outside_links=outside_links)}
    else:
        found = splits or tuple(s for s in SPLITS if s == "train" or os.path.isdir(os.path.join(root, s)))
        indexes = scan_folder(root, found, on_bad_image=on_bad_image, outside_links=outside_links)
    names = next(iter(indexes.values())).class_names
    os.makedirs(out, exist_ok=True)
    with _only_conversion(out):
        return _convert(indexes, out, names, on_bad_image, workers, progress, say, keep=splits is not None)


def _convert(indexes, out, names, on_bad_image, workers, progress, say, keep) -> dict:
    """:func:`convert`'s writing, with the scans done and ``out`` locked; ``keep``: the splits
    of an earlier conversion into ``out`` that are not converted now stay listed."""
    from jaxcnn.data.folder import FolderSource
    from jaxcnn.data.records import record_file, write_sidecar, write_split

    previous = _previous_sidecar(out)
    info = _kept_splits(out, previous, names, set(indexes)) if keep else {}
    token, written_files = secrets.token_hex(4), []
    try:
        for split, index in indexes.items():
            path = os.path.join(out, record_file(split, token))
            written_files.append(path)
            bar = _progress_bar(len(index), split, progress)
            try:
                written, bad, per_class = write_split(index, path, on_bad_image=on_bad_image, workers=workers,
                                           progress=None if bar is None else bar.update)
            finally:
                if bar is not None:
                    bar.close()
            bad = list(index.unlisted) + list(index.skipped) + bad
            for message in bad[:20]:
                say(f"[jaxcnn-data] skipped {message}")
            if len(bad) > 20:
                say(f"[jaxcnn-data] ... and {len(bad) - 20} more")
            # The folder's listing (jaxcnn.data.folder.FolderSource.fingerprint): a run on the
            # records tells one conversion from another by it (a changed folder converted again).
            info[split] = {"file": os.path.basename(path), "count": written, "skipped": len(bad),
                           "sha256": FolderSource(index).fingerprint()["sha256"], "per_class": per_class}
            say(f"[jaxcnn-data] {split}: {written} images in {len(names)} classes -> {path} "
                f"({len(bad)} skipped)")
        if set(info) == {"train"}:
            say("[jaxcnn-data] one split, train: data.val_split holds out a share of each class of it in code")
        write_sidecar(out, names, info)
    except BaseException:
        for path in written_files:  # not named by any dataset.json: nothing reads them
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        raise
    _remove_replaced(out, previous, info, say)
    return info


@contextlib.contextmanager
def _only_conversion(out: str):
    """Holds an exclusive ``flock`` on the directory ``out`` while a conversion writes into it:
    a second ``convert`` into the same ``OUT`` is a ValueError (each would remove the other's
    files). On a file system without locks nothing is guarded."""
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{out}: another jaxcnn-data convert is writing into it; wait for it to "
                             "end, or give another OUT") from None
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _previous_sidecar(out: str):
    """The ``dataset.json`` an earlier ``convert`` wrote to ``out`` (None: none, or one this
    version does not read, which is replaced)."""
    from jaxcnn.data.records import SIDECAR, read_sidecar
    if not os.path.isfile(os.path.join(out, SIDECAR)):
        return None
    try:
        return read_sidecar(out)
    except DataError:
        return None


# The files a conversion writes (jaxcnn.data.records.record_file), and their partial files.
_RECORD_FILE = re.compile(r".+-[0-9a-f]{8}\.array_record(\.partial)?")


def _remove_replaced(out: str, previous, info: dict, say) -> None:
    """Removes the record files of ``out`` that the new sidecar (``info``) does not name: the
    ones the ``previous`` sidecar named (``<split>.array_record`` before conversions had
    tokens, too), and any of a conversion's names (`_RECORD_FILE`) that one killed before its
    switch left. A trainer that still reads them keeps its open files (POSIX), and stops at
    its next evaluation when it sees that ``dataset.json`` changed
    (`jaxcnn.data.ImageData.changes_since_opened`)."""
    earlier = set() if previous is None else {entry["file"] for entry in previous["splits"].values()}
    named = {entry["file"] for entry in info.values()}
    for name in sorted(os.listdir(out)):
        if name in named or not (name in earlier or _RECORD_FILE.fullmatch(name)):
            continue
        path = os.path.join(out, name)
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            say(f"[jaxcnn-data] could not remove the replaced {path} ({err.strerror or err})")


def _kept_splits(out: str, previous, class_names, converting: set) -> dict:
    """The sidecar entries of the splits an earlier ``convert`` wrote to ``out`` (``previous``,
    its sidecar) that this one leaves alone (``--splits val`` after a whole conversion): kept,
    so their records stay listed (the new sidecar listed only ``val``, and the ``train``
    records were lost to the reader). Splits of other classes than ``class_names`` cannot be
    kept: a ValueError."""
    if previous is None:
        return {}
    kept = {split: entry for split, entry in previous["splits"].items()
            if split not in converting and os.path.isfile(os.path.join(out, entry["file"]))}
    if kept and list(previous["class_names"]) != list(class_names):
        raise ValueError(f"{out} holds the {', '.join(sorted(kept))} records of other classes "
                         f"({len(previous['class_names'])}: {previous['class_names'][:5]}...; now {len(class_names)}: "
                         f"{list(class_names)[:5]}...): convert those splits too (--splits), or give a new OUT")
    return kept


def _check_out_dir(out: str) -> None:
    """``OUT`` of either command is a directory to create or fill: a file there is a ValueError."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out} is a file; give a directory to write into (created if missing)")


def _check_out_outside_root(root: str, out: str) -> None:
    """``OUT`` of ``convert`` may not be ``ROOT`` or lie inside it (links resolved): the record
    files would sit among the images, a class folder of their own under a split, and the next
    scan would read them as data."""
    real_root, real_out = os.path.realpath(root), os.path.realpath(out)
    if real_out == real_root or real_out.startswith(real_root.rstrip(os.sep) + os.sep):
        where = "is the image folder ROOT" if real_out == real_root else f"is inside the image folder ROOT {root}"
        raise ValueError(f"OUT {out} {where}: the record files would be read as images next time; "
                         "give a directory outside it")


def _digit_list(text: str):
    try:
        digits = tuple(int(d) for d in text.split(","))
    except ValueError:
        digits = ()
    if not digits or len(set(digits)) != len(digits) or not all(0 <= d <= 9 for d in digits):
        raise argparse.ArgumentTypeError(f"expected distinct digits 0-9 separated by commas, got {text!r}")
    return digits


def _write_example(args) -> None:
    """``jaxcnn-data shapes|digits OUT``: a new example folder (one over a folder already holding
    images would mix its images in among them, some replacing them)."""
    if args.command == "shapes":
        from jaxcnn.data.shapes import write_shapes_folder

        for split in ("train", "val"):
            folder = os.path.join(args.out, split)
            if os.path.isdir(folder) and os.listdir(folder):
                raise ValueError(f"{folder} already holds files; jaxcnn-data shapes writes a new example "
                                 "folder: give a directory without train/ and val/ (created if missing)")
        written = write_shapes_folder(args.out, per_class=(args.train, args.val), seed=args.seed)
        print(f"[jaxcnn-data] wrote {len(written['train'])} training and {len(written['val'])} "
              f"validation images to {args.out}")
        return
    from jaxcnn.data.digits import write_digits_folder

    if os.path.isdir(args.out) and os.listdir(args.out):
        raise ValueError(f"{args.out} already holds files; jaxcnn-data digits writes a new example folder")
    written = write_digits_folder(args.out, digits=args.digits, per_class=args.per_class, seed=args.seed)
    print(f"[jaxcnn-data] wrote {sum(map(len, written.values()))} images of the digits "
          f"{', '.join(written)} to {args.out} (class folders: train with data.val_split)")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_out_dir(args.out)
        if args.command in ("shapes", "digits"):
            _write_example(args)
            return 0
        from jaxcnn.data.images import missing_packages
        if missing := missing_packages("records", loader=False):
            raise ValueError(f"jaxcnn-data convert needs {', '.join(missing)}, not installed: "
                             "pip install -e \".[data]\" (or pip install 'jaxcnn[data]')")
        _check_out_outside_root(args.root, args.out)
        splits = None if args.splits is None else tuple(dict.fromkeys(s for s in args.splits.split(",") if s))
        if splits == ():
            raise ValueError("--splits names no split")
        convert(args.root, args.out, splits=splits, on_bad_image=args.on_bad_image, workers=args.workers,
                outside_links=args.outside_links,
                progress=not args.no_progress)
    except (DataError, ValueError, OSError) as err:
        if isinstance(err, OSError) and err.filename and err.strerror:  # not "[Errno 13] ...: 'x'"
            err = f"{err.filename}: {err.strerror}"
        print(f"jaxcnn-data: error: {err}".replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxcnn-data: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
