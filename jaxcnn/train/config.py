"""Run configuration: a YAML file, its ``base:`` includes and dotted overrides.

A run is described by one YAML file (``configs/*.yaml``) plus command-line overrides such as
``train.steps=100`` or ``optim.schedule.name=cosine``. :func:`load_config` reads the file with
``yaml.safe_load`` (its ``base:`` files first, deep-merged under it), applies the overrides
in order (each value parsed as YAML) and checks everything against :data:`SCHEMA` before any
compute: an unknown key, a wrong type, an out-of-range value or a missing required key is a
:class:`ConfigError` whose one-line message names the dotted key, the bad value, what was
expected and which file or override it came from. The result is an immutable
:class:`Config` with attribute access; :func:`to_dict` gives it back as plain data, which
loads to an equal config.

The schema is the registry of keys: each :class:`Field` says everything about its key (type,
default, choices, doc, whether it changes training, when it is used, its rules across keys),
and resume-change detection (:func:`config_changes`), ``--print-config``'s notes
(:func:`dump_config`) and validation all derive from it. Adding a key is writing its
``Field`` and the line that reads it.

Durations are an int number of steps or ``"<N>st"``/``"<N>ep"``, turned into steps by
:func:`resolve_duration` once the epoch length is known. YAML's quirks as decided here
(``yes``/``no`` kept as words, duplicate keys refused), the ranges and why the schema is
hand-written: ``docs/design/config.md``.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Mapping
from typing import Any, NamedTuple, Sequence

import yaml

from jaxcnn.errors import ConfigError  # noqa: F401  (re-exported: defined here before)

# The resize filters of data.augment.interpolation (jaxcnn.data.transforms.INTERPOLATIONS).
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


# --------------------------------------------------------------------- schema

class Field(NamedTuple):
    """One config key: its type, default, constraints and one-line doc.

    ``type`` is one of ``int``, ``float``, ``bool``, ``str``, ``duration``,
    ``list`` (items checked by ``item``, optional exact ``length``) or ``dict``
    (string keys; values checked by ``item`` when given, else any YAML data).
    ``low``/``high`` bound numbers, durations (``low`` only, 0 or > 0) and the
    length of strings; ``extra`` lists values accepted outside the range.

    The rest is what the trainer derives from the key, so that adding a key is writing its
    ``Field`` and the line that reads it:

    * ``trains``: changing the value changes what training computes. A resumed run whose
      config changes such a key stops (``checkpoint.on_config_change``); the other keys
      (logging, checkpointing, evaluation cadence, data feeding, kernel choice, device
      layout) may change freely. A section's keys are marked by :func:`_not_training`.
    * ``used_when``: ``(chooser key, values)``: the key is read only when the chooser holds
      one of the values. ``--print-config`` marks it otherwise, and a run that sets it away
      from its default says that it is not used.
    * ``rules``: checks across keys, each ``rule(value, config) -> problem or None`` over the
      resolved config (plain dicts); a problem is raised as a :class:`ConfigError` naming
      this key. They run after every key has been checked alone, in schema order.
    * ``path``: the value names a file or directory (a leading ``~`` is the home directory):
      ``"input"``, read again when the run is resumed or exported, relative to the directory
      it was started in, or ``"output"``.
    * ``clears``: the dotted key of the other of an exactly-one pair; a layer (a file over
      its base, an override) that sets this key clears that one.
    * ``aliases``: what other libraries (PyTorch, timm, Keras) call the key; an unknown key
      of such a name, in any section, is answered with this one.
    * ``example``: a value of the key's form, shown when a value of another type is given
      (a list key's default hint is the value given, in brackets).
    """

    type: str
    default: Any
    doc: str
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    nullable: bool = False
    required: bool = False
    extra: tuple = ()
    item: "Field | None" = None
    length: int | None = None
    trains: bool = True
    used_when: tuple[str, tuple] | None = None
    rules: tuple = ()
    path: str | None = None
    clears: str | None = None
    aliases: tuple = ()
    example: str | None = None


_f = Field  # short name keeps the schema table readable

# Largest int a key takes (unless its schema says less): the step counter is int32, and so are the
# step arithmetic of schedules and the data pipeline's per-step draws.
MAX_INT = MAX_STEPS = 2**31 - 1
# Seeds: jax.random.PRNGKey keeps 32 bits (without jax_enable_x64; 2**32 gives the key of 0).
MAX_SEED = 2**32 - 1
_MAX_FLOAT_INT = 2**1023  # ints beyond this (and beyond float's range) cannot become a float


_POS_INT = dict(low=1)
_POS_FLOAT = dict(low=0.0, open_low=True)
_UNIT = dict(low=0.0, high=1.0)          # [0, 1]
_UNIT_OPEN_HIGH = dict(low=0.0, high=1.0, open_high=True)


def _not_training(section: dict) -> dict:
    """``section`` with every key marked ``trains=False``: settings that change how a run is
    logged, checkpointed, fed or laid out over devices, never what it computes."""
    return {k: _not_training(v) if isinstance(v, dict) else v._replace(trains=False)
            for k, v in section.items()}


# ------------------------------------------------------- rules across keys
# Each takes (the key's value, the resolved config) and returns the problem, or None.

def _one_run_length(steps, cfg):
    epochs = cfg["train"]["epochs"]
    if (steps is None) == (epochs is None):
        return f"set exactly one of train.steps or train.epochs (got steps={steps!r}, epochs={epochs!r})"


_DATA_PATHS = {"cifar10": "directory", "npz": ".npz file", "folder": "image folder",
               "records": "directory written by jaxcnn-data convert"}


def _path_given(path, cfg):
    source = cfg["data"]["source"]
    if source in _DATA_PATHS and path is None:
        return f"data.source={source!r} needs data.path (a {_DATA_PATHS[source]}), got null"


def _image_size_fits_source(size, cfg):
    source = cfg["data"]["source"]
    if size is None:
        return None
    if source in ("folder", "records"):
        if len(size) not in (2, 3) or (len(size) == 3 and size[2] != 3):
            return f"expected [H, W] (RGB crops of that size) for data.source={source!r}, got {size!r}"
    elif len(size) != 3:
        return f"expected a list of 3 items [H, W, C], got {size!r}"


def _crop_fits(resize, cfg):
    size = cfg["data"]["image_size"]
    if cfg["data"]["source"] not in _IMAGE_FILES:  # the key is not used there
        return None
    if resize is not None and size is not None and resize < max(size[:2]):
        return (f"{resize} is smaller than the crop data.image_size={list(size[:2])}: the centre "
                "crop would not fit")


def _val_split_source(val_split, cfg):
    source = cfg["data"]["source"]
    if val_split is not None and source not in _IMAGE_FILES:
        return (f"{val_split:g} splits an image folder or records (data.source: folder or records); "
                f"data.source={source!r} has its own test split: set data.val_split: null")


def _ordered_pair(pair, cfg):
    if pair is not None and pair[0] > pair[1]:
        return f"expected [lo, hi] with lo <= hi, got {pair!r}"


# Each augmenting key's values that augment nothing (remode's default: it fills nothing without reprob).
_AUGMENT_OFF = {"scale": (None,), "ratio": (None,), "hflip": (None, 0.0), "vflip": (0.0,), "crop_padding": (0,),
                "color_jitter": (None,), "auto_augment": (None,), "reprob": (0.0,), "remode": ("pixel",)}


def _no_aug_alone(no_aug, cfg):
    augment = cfg["data"]["augment"]
    if not no_aug:
        return None
    given = [f"data.augment.{k}={augment[k]!r}" for k, off in _AUGMENT_OFF.items() if augment[k] not in off]
    given += [f"data.augment.{k}.alpha={augment[k]['alpha']!r}" for k in ("mixup", "cutmix") if augment[k]["alpha"]]
    if given:
        return f"true (no augmentation at all) but {given[0]} is set: drop one"


def _interpolation_resizes(interpolation, cfg):
    augment, source = cfg["data"]["augment"], cfg["data"]["source"]
    if (interpolation != "bilinear" and source not in _IMAGE_FILES
            and augment["scale"] is None and augment["ratio"] is None):
        return (f"{interpolation!r} is the filter of the random-resized crop (data.augment.scale/ratio), and "
                f"data.source={source!r} has none: its images are used at their size; set data.augment.scale")


def _decoded_images_only(value, cfg):
    """The photometric steps run on decoded image files (Pillow), not on in-memory arrays."""
    source = cfg["data"]["source"]
    if value not in (None, 0, 0.0) and source not in _IMAGE_FILES:
        return (f"{_short(value)} works on decoded image files (data.source: folder or records); "
                f"data.source={source!r} is in-memory arrays, which it does not augment")


def _color_jitter_factors(factors, cfg):
    if factors is not None and (len(factors) not in (3, 4) or (len(factors) == 4 and factors[3] > 0.5)):
        return (f"expected [brightness, contrast, saturation] or [..., hue] with hue <= 0.5 (timm's and "
                f"torchvision's factors), got {list(factors)!r}")


def _auto_augment_policy(value, cfg):
    """timm's RandAugment / TrivialAugment / AugMix string, parsed as training will parse it."""
    if value is None:
        return None
    from jaxcnn.data.photometric import parse_auto_augment
    try:
        parse_auto_augment(value)
    except ValueError as err:
        return str(err).removeprefix(f"auto_augment {value!r}: ")
    if cfg["data"]["augment"]["color_jitter"] is not None and "3a" not in value:
        return (f"{value!r} with data.augment.color_jitter: timm turns colour jitter off under auto_augment "
                f"(unless its string has '3a'); set one of them")


def _one_eval_resize(crop_pct, cfg):
    resize = cfg["data"]["eval_resize"]
    if crop_pct is not None and resize is not None:
        return (f"{crop_pct!r} and data.eval_resize={resize!r} both set the evaluation resize "
                "(crop_pct: floor(max(image_size) / crop_pct)); set one")


def _classes_fit_model(classes, cfg):
    model_classes = cfg["model"]["num_classes"]
    if classes is not None and model_classes is not None and classes > model_classes:
        return f"{classes} label classes do not fit a model with model.num_classes={model_classes}"


def _mix_probabilities(mixup_prob, cfg):
    augment = cfg["data"]["augment"]
    cutmix_prob = augment["cutmix"]["prob"]
    if (augment["mixup"]["alpha"] > 0 and augment["cutmix"]["alpha"] > 0
            and mixup_prob + cutmix_prob > 1 + 1e-9):
        return (f"{mixup_prob:g} + data.augment.cutmix.prob {cutmix_prob:g} is more than 1 (a batch "
                "gets one or the other); e.g. set both to 0.5")


def _skip_has_source(skip, cfg):
    if skip and cfg["model"]["init_from"] is None:
        return f"{skip} re-initialises layers of model.init_from's parameters, but model.init_from is null"


def _needed_by_schedule(name, what):
    def rule(value, cfg):
        if cfg["optim"]["schedule"]["name"] == name and not value:
            return f"schedule {name!r} needs {what}"
    return rule


def _no_onecycle_warmup(warmup, cfg):
    if cfg["optim"]["schedule"]["name"] == "onecycle" and warmup != 0:
        return f"onecycle warms up by itself (pct_start); expected 0, got {warmup!r}"


def _nesterov_has_momentum(nesterov, cfg):
    if cfg["optim"]["name"] == "sgd" and nesterov and cfg["optim"]["momentum"] == 0:
        return "Nesterov momentum needs optim.momentum > 0"


def _one_micro_batch_count(accumulate, cfg):
    micro = cfg["parallel"]["pipeline"]["microbatches"]
    if micro is not None and accumulate not in (1, micro):
        return (f"{accumulate}, but parallel.pipeline.microbatches={micro} (both are micro-batches "
                "per step: set one)")


def _scale_in_bounds(init, cfg):
    prec = cfg["precision"]
    if prec["loss_scale"] in ("static", "dynamic") and not prec["min_scale"] <= init <= prec["max_scale"]:
        return (f"expected min_scale ({prec['min_scale']:g}) <= loss_scale_init <= max_scale "
                f"({prec['max_scale']:g}), got {init:g}")


def _process_in_range(process_id, cfg):
    count = cfg["distributed"]["num_processes"]
    if process_id is not None and count is not None and process_id >= count:
        return f"expected < num_processes ({count}), got {process_id}"


def _host_and_port(address, cfg):
    if address is not None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"expected 'host:port', got {address!r}"


_IMAGE_FILES = ("folder", "records")
_ARRAY_SOURCES = ("mnist", "cifar10", "npz", "synthetic")
_SCHEDULED_WARMUP = ("constant", "step", "multistep", "cosine")
_ADAM_FAMILY = ("adam", "adamw", "lamb")

SCHEMA: dict[str, dict] = {
    "model": {
        "name": _f("str", None, "model registry name (jaxcnn.models.names())", required=True, low=1),
        "num_classes": _f("int", None, "classifier outputs; null = the model's default", nullable=True, **_POS_INT),
        "extra_outputs": _f("bool", False, "folder/records: a model.num_classes above the data's classes is on "
                            "purpose (outputs no image is labelled with); refused otherwise",
                            used_when=("data.source", _IMAGE_FILES), trains=False),
        "options": _f("dict", {}, "extra keyword arguments for the model constructor, e.g. {cifar_stem: true}"),
        "init_from": _f("str", None, "start from these parameters instead of a random init: a .npz/.safetensors "
                        "file (params and state, as jaxcnn-train writes them), a PyTorch state dict saved as "
                        ".safetensors (torchvision/timm names: conv1.weight, fc.weight...) or a run directory; checked "
                        "against the model before any compute; null = random init from train.seed",
                        nullable=True, low=1, path="input", aliases=("pretrained", "weights")),
        "init_from_skip": _f("list", [], "layers re-initialised from train.seed instead of loaded from "
                             "model.init_from (fine-tuning to another class count): layer paths such as fc "
                             "or layer4.1, the same in torchvision's and jaxcnn's naming, or full parameter "
                             "names as the file names them (fc.weight, fc.w)",
                             item=_f("str", None, "layer path", low=1), rules=(_skip_has_source,)),
        "impl": _f("str", "auto", "kernels of the convolution/pooling layers and of training "
                   "BatchNorm's reductions: auto (XLA, or a Pallas kernel where the autotuner or "
                   "the GPU check measured it faster on this GPU), xla, or pallas "
                   "(see docs/guides/kernels.md)", choices=("auto", "xla", "pallas"), trains=False),
        "batch_norm_grad": _f("str", "auto", "BatchNorm's training form: auto (explicit on the CPU "
                              "and GPUs, where it was measured faster), explicit (the fewest passes "
                              "over the activation, a following ReLU folded in), autodiff, or "
                              "closed_form (see F.batch_norm_train)",
                              choices=("auto", "explicit", "autodiff", "closed_form"), trains=False),
        "conv_bn": _f("str", "auto", "Conv -> BatchNorm -> ReLU chains in training: auto (fused "
                      "into the Mosaic GPU convolution only where bench_mgpu.py --fused --tune "
                      "measured a win on this Hopper GPU), off, or mosaic (fused wherever the "
                      "kernels run the convolution; see docs/guides/kernels.md)",
                      choices=("auto", "off", "mosaic"), trains=False),
    },
    "data": {
        "source": _f("str", "mnist", "dataset: mnist, cifar10, npz, synthetic, folder (an image folder "
                     "PATH/{train,val}/<class>/<image>, or PATH/<class>/<image> with data.val_split) or records "
                     "(written by jaxcnn-data convert)",
                     choices=("mnist", "cifar10", "npz", "synthetic", "folder", "records")),
        "path": _f("str", None, "dataset file/directory (relative to the working directory); "
                   "null = packaged MNIST sample for mnist", nullable=True, low=1, path="input",
                   used_when=("data.source", ("mnist", "cifar10", "npz", "folder", "records")),
                   rules=(_path_given,)),
        "batch_size": _f("int", 128, "global training batch size (all devices together)", **_POS_INT),
        "eval_batch_size": _f("int", None, "global evaluation batch size; null = batch_size", nullable=True,
                              trains=False, **_POS_INT),
        "image_size": _f("list", None, "synthetic: image shape [H, W, C]; folder/records: the crop size [H, W] "
                         "both transforms produce; null = the model's default input shape",
                         nullable=True, item=_f("int", None, "dimension", **_POS_INT),
                         used_when=("data.source", ("synthetic",) + _IMAGE_FILES), rules=(_image_size_fits_source,),
                         example="[224, 224] (folder, records) or [32, 32, 3] (synthetic)"),
        "workers": _f("int", 0, "folder/records: grain worker processes that read, decode and augment "
                      "images (0 = in the training process's prefetch thread); the same batches for "
                      "any count", low=0, trains=False, used_when=("data.source", _IMAGE_FILES)),
        "on_bad_image": _f("str", "fail", "folder/records: a corrupt, truncated or unreadable image, or a "
                           "non-image file: skip it (counted in metrics.jsonl) or stop the run",
                           choices=("skip", "fail"), used_when=("data.source", _IMAGE_FILES),
                           trains=False),  # a run stopped by a bad image (fail) may go on skipping it
        "outside_links": _f("bool", False, "folder: follow links (to class folders, sub-folders or "
                            "images) that lead outside data.path; false = such a link is an error "
                            "naming it", used_when=("data.source", ("folder",)), trains=False),
        "val_split": _f("float", None, "folder/records: hold out this share of each class for validation "
                        "(rounded; at least one image of a class of two or more, none of a class of one), "
                        "chosen by data.seed, from a folder of class folders only (PATH/<class>/<image>, or "
                        "PATH/train/<class>/<image> without PATH/val) or records converted from one; "
                        "null = validate on PATH/val", nullable=True, low=0.0, high=1.0, open_low=True,
                        open_high=True, used_when=("data.source", _IMAGE_FILES), rules=(_val_split_source,),
                        aliases=("validation_split",), example="0.1"),
        "eval_resize": _f("int", None, "folder/records: resize the shorter side to this before the "
                          "evaluation centre crop; null = data.augment.crop_pct's, else max(image_size) / 0.875 "
                          "(224 -> 256)",
                          nullable=True, trains=False, used_when=("data.source", _IMAGE_FILES),
                          rules=(_crop_fits,), **_POS_INT),
        "num_train": _f("int", 1024, "synthetic: number of training images",
                        used_when=("data.source", ("synthetic",)), **_POS_INT),
        "num_eval": _f("int", 256, "synthetic: number of evaluation images", low=0,
                       used_when=("data.source", ("synthetic",))),
        "num_classes": _f("int", None, "synthetic: number of label classes; null = model.num_classes or 10",
                          nullable=True, low=2, used_when=("data.source", ("synthetic",)),
                          rules=(_classes_fit_model,)),
        "augment": {
            "no_aug": _f("bool", False, "no augmentation at all (data.augment: none is short for this; only "
                         "interpolation and crop_pct may be set with it): folder/records train on evaluation's "
                         "resize and centre crop, arrays as they are, no mixup/cutmix", rules=(_no_aug_alone,)),
            "scale": _f("list", None, "random-resized crop (timm/torchvision scale): [lo, hi] range of the crop's "
                        "area fraction; null = the source's recipe ([0.08, 1] for folder/records, no crop for "
                        "arrays; arrays resize the crop back to their own size). [1, 1] with ratio [1, 1] is a "
                        "plain resize of a square image (of a non-square one, its centred square)",
                        nullable=True, length=2, rules=(_ordered_pair,), example="[0.8, 1.0]",
                        item=_f("float", None, "area fraction", low=0.0, high=1.0, open_low=True)),
            "ratio": _f("list", None, "random-resized crop: [lo, hi] range of the crop's aspect ratio (width / "
                        "height, log-uniform); null = [3/4, 4/3]", nullable=True, length=2,
                        rules=(_ordered_pair,), example="[0.75, 1.333]",
                        item=_f("float", None, "aspect ratio", low=0.0, open_low=True)),
            "interpolation": _f("str", "bilinear", "Pillow filter of the random-resized crop's resize and of "
                                "folder/records evaluation resize", choices=INTERPOLATIONS,
                                rules=(_interpolation_resizes,)),
            "hflip": _f("float", None, "probability of a horizontal flip; null = the source's recipe (0.5 for "
                        "folder/records, 0 for arrays; the old key flip: true reads as 0.5)", nullable=True,
                        **_UNIT),
            "vflip": _f("float", 0.0, "probability of a vertical flip", **_UNIT),
            "crop_padding": _f("int", 0, "random crop: pad each side by this many zero pixels, crop back at a "
                               "random offset (torchvision RandomCrop(padding=)); after the crop and flips; 0 = off",
                               low=0),
            "color_jitter": _f("list", None, "folder/records: torchvision ColorJitter factors [brightness, "
                               "contrast, saturation] or [..., hue], or one number for the first three "
                               "(timm's color_jitter; hue at most 0.5), "
                               "each adjustment's factor uniform in [1 - f, 1 + f] (hue: [-h, h]), in a random "
                               "order, after the flips; null = off", nullable=True,
                               rules=(_color_jitter_factors, _decoded_images_only),
                               example="0.4 (= [0.4, 0.4, 0.4]) or [0.4, 0.4, 0.4, 0.1]",
                               item=_f("float", None, "factor", low=0.0)),
            "auto_augment": _f("str", None, "folder/records: timm's RandAugment ('rand-m9-mstd0.5-inc1'), "
                               "TrivialAugment ('trivialaugment') or AugMix ('augmix-m5-w4-d2') string, after "
                               "the flips, filling with the ImageNet mean; null = off", nullable=True, low=1,
                               rules=(_auto_augment_policy, _decoded_images_only)),
            "reprob": _f("float", 0.0, "folder/records: probability of timm's random erasing (a box of 2-33% "
                         "of the image, aspect 0.3-3.3) on the finished uint8 crop; 0 = off",
                         rules=(_decoded_images_only,), **_UNIT),
            "remode": _f("str", "pixel", "random erasing's fill: const (the ImageNet mean: timm's zero after "
                         "normalisation), rand (one colour of the mean + std * N(0, 1) per box) or pixel (that "
                         "noise per pixel; clipped to 0-255, where timm's normalised noise is not)",
                         choices=("const", "rand", "pixel")),
            "crop_pct": _f("float", None, "folder/records: evaluation resizes the shorter side to "
                           "floor(max(image_size) / crop_pct) before the centre crop (timm's rule; with "
                           "no_aug, training too); null = data.eval_resize, else max(image_size) / 0.875 "
                           "rounded (224 -> 256); set one of the two",
                           nullable=True, low=1 / 8, high=1.0, trains=False,  # at most 8x the crop
                           used_when=("data.source", _IMAGE_FILES), rules=(_one_eval_resize,)),
            "mixup": {
                "alpha": _f("float", 0.0, "mixup: Beta(alpha, alpha) weight of each image against "
                            "its partner (the batch reversed); 0 = off", low=0.0),
                "prob": _f("float", 1.0, "mixup: probability that a batch is mixed (a batch gets "
                           "cutmix or mixup, never both)", rules=(_mix_probabilities,), **_UNIT),
            },
            "cutmix": {
                "alpha": _f("float", 0.0, "cutmix: Beta(alpha, alpha) draws the area kept; 0 = off",
                            low=0.0),
                "prob": _f("float", 1.0, "cutmix: probability that a batch gets a pasted box "
                           "(with mixup on too, mixup.prob + cutmix.prob must be at most 1)", **_UNIT),
            },
        },
        "normalize": _f("bool", True, "subtract the per-channel mean and divide by the std of the dataset"),
        "prefetch": _f("int", 2, "batches prepared ahead on a background thread (0 = none)", low=0,
                       trains=False),
        "seed": _f("int", None, "seed of shuffling, augmentation and data.val_split's held-out images; "
                   "null = train.seed", nullable=True, low=0, high=MAX_SEED),
    },
    "optim": {
        "name": _f("str", "adamw", "optimiser", choices=("sgd", "adam", "adamw", "lars", "lamb")),
        "lr": _f("float", 1e-3, "peak learning rate", aliases=("learning_rate",), **_POS_FLOAT),
        "momentum": _f("float", 0.9, "sgd/lars momentum (0 = plain sgd)", used_when=("optim.name", ("sgd", "lars")),
                       **_UNIT_OPEN_HIGH),
        "nesterov": _f("bool", False, "Nesterov momentum (sgd, lars)", used_when=("optim.name", ("sgd", "lars")),
                       rules=(_nesterov_has_momentum,)),
        "b1": _f("float", 0.9, "adam-family first-moment decay", used_when=("optim.name", _ADAM_FAMILY),
                 **_UNIT_OPEN_HIGH),
        "b2": _f("float", 0.999, "adam-family second-moment decay", used_when=("optim.name", _ADAM_FAMILY),
                 **_UNIT_OPEN_HIGH),
        "eps": _f("float", 1e-8, "adam-family denominator epsilon; lars trust-ratio epsilon", low=0.0,
                  used_when=("optim.name", _ADAM_FAMILY + ("lars",))),
        "weight_decay": _f("float", 0.0, "weight decay: L2 added to the gradient for sgd/adam/lars, "
                           "decoupled for adamw/lamb", low=0.0, aliases=("wd",)),
        "mask_weight_decay": _f("bool", True, "no weight decay (and no lars trust ratio) on parameters "
                                "with ndim <= 1: biases and norm scales"),
        "trust_coefficient": _f("float", 1e-3, "lars trust coefficient", used_when=("optim.name", ("lars",)),
                                **_POS_FLOAT),
        "grad_clip_norm": _f("float", None, "clip gradients to this global norm first; null = no clipping",
                             nullable=True, **_POS_FLOAT),
        "mu_dtype": _f("str", None, "dtype of the first-moment/momentum buffer; null = parameter dtype",
                       nullable=True, choices=("bf16", "f32")),
        "label_smoothing": _f("float", 0.0, "label smoothing of the cross-entropy loss", **_UNIT_OPEN_HIGH),
        "schedule": {
            "name": _f("str", "constant", "learning-rate schedule",
                       choices=("constant", "step", "multistep", "cosine", "onecycle")),
            "warmup": _f("duration", 0, "linear warm-up length (not for onecycle)", low=0,
                         used_when=("optim.schedule.name", _SCHEDULED_WARMUP), rules=(_no_onecycle_warmup,)),
            "warmup_init_fraction": _f("float", 0.0, "warm-up starts at this fraction of lr",
                                       used_when=("optim.schedule.name", _SCHEDULED_WARMUP), **_UNIT),
            "decay_rate": _f("float", 0.1, "step/multistep: factor applied at each decay", low=0.0, high=1.0,
                             open_low=True, used_when=("optim.schedule.name", ("step", "multistep"))),
            "decay_every": _f("duration", None, "step: decay every this long (required for step)",
                              nullable=True, low=0, open_low=True, used_when=("optim.schedule.name", ("step",)),
                              rules=(_needed_by_schedule("step", "decay_every (a duration), got null"),)),
            "milestones": _f("list", [], "multistep: decay at these durations from the start (required)",
                             item=_f("duration", None, "milestone", low=0, open_low=True),
                             used_when=("optim.schedule.name", ("multistep",)),
                             rules=(_needed_by_schedule("multistep", "a non-empty list of milestones"),)),
            "final_lr_fraction": _f("float", 0.0, "cosine: final learning rate as a fraction of lr",
                                    used_when=("optim.schedule.name", ("cosine",)), **_UNIT),
            "pct_start": _f("float", 0.3, "onecycle: fraction of the run spent increasing the lr",
                            low=0.0, high=1.0, open_low=True, open_high=True,
                            used_when=("optim.schedule.name", ("onecycle",))),
            "div_factor": _f("float", 25.0, "onecycle: initial lr = lr / div_factor", low=1.0,
                             used_when=("optim.schedule.name", ("onecycle",))),
            "final_div_factor": _f("float", 1e4, "onecycle: final lr = initial lr / final_div_factor", low=1.0,
                                   used_when=("optim.schedule.name", ("onecycle",))),
        },
    },
    "train": {
        "steps": _f("int", None, "run length in optimiser steps (set exactly one of steps/epochs)",
                    nullable=True, clears="train.epochs", rules=(_one_run_length,), **_POS_INT),
        "epochs": _f("float", None, "run length in epochs, fractions allowed (exactly one of steps/epochs)",
                     nullable=True, low=0.0, open_low=True, high=MAX_STEPS, clears="train.steps",
                     aliases=("num_epochs", "max_epochs")),
        "seed": _f("int", 0, "seed of parameter initialisation and dropout", low=0, high=MAX_SEED),
        "compilation_cache": _f("str", "~/.cache/jaxcnn/xla", "jaxcnn-train/-eval: JAX's persistent compilation "
                                "cache, so a repeated run loads its compiled programs (unless "
                                "JAX_COMPILATION_CACHE_DIR chose one); null = off", nullable=True, low=1,
                                trains=False),
        "eval_every": _f("duration", "1ep", "evaluate this often; null = only at the end", nullable=True,
                         low=0, open_low=True, trains=False),
        "nan_policy": _f("str", "stop", "non-finite loss: stop the run, or skip the update",
                         choices=("stop", "skip")),
        "ema_decay": _f("float", 0.0, "keep an exponential moving average of the parameters with this "
                        "decay (e.g. 0.9998), evaluated and exported instead of them; 0 = off",
                        **_UNIT_OPEN_HIGH),
        "accumulate_steps": _f("int", 1, "split each step's batch into this many micro-batches whose "
                               "gradients are averaged into one update (data.batch_size stays the "
                               "batch of one update; BatchNorm normalises each micro-batch alone)",
                               rules=(_one_micro_batch_count,), **_POS_INT),
        "early_stopping": {
            "patience": _f("int", None, "stop after this many evaluations without improvement of "
                           "the metric (then evaluate, checkpoint and export as at the end); "
                           "null = off", nullable=True, **_POS_INT),
            "metric": _f("str", "top1", "eval metric watched (loss: lower is better)",
                         choices=("top1", "top5", "loss")),
            "min_delta": _f("float", 0.0, "an improvement must exceed this", low=0.0),
        },
    },
    "prune": {
        "amount": _f("float", 0.0, "magnitude-prune this fraction of the conv2d/linear weights (or output "
                     "channels) of the initial parameters and hold them at exactly zero while training "
                     "(0 = off)", **_UNIT_OPEN_HIGH),
        "scope": _f("str", "global", "rank the weights of all layers together, or prune each layer alike",
                    choices=("global", "layer")),
        "structure": _f("str", "unstructured", "prune single weights, or whole output channels (never "
                        "those of the last layer)", choices=("unstructured", "channel")),
    },
    "checkpoint": _not_training({
        "enabled": _f("bool", True, "save train-state checkpoints"),
        "every": _f("duration", "1ep", "save this often (and at the end)", low=0, open_low=True),
        "keep": _f("int", 3, "number of recent checkpoints kept", **_POS_INT),
        "keep_best": _f("bool", False, "also keep the checkpoint with the best evaluation accuracy"),
        "resume": _f("str", "auto", "auto: resume if a checkpoint exists; must: fail without one; never",
                     choices=("auto", "must", "never")),
        "on_error": _f("str", "stop", "a failed save stops the run or only warns", choices=("stop", "warn")),
        "on_config_change": _f("str", "stop", "resuming a run under settings that train differently "
                               "(a key other than logging, checkpointing, evaluation cadence, data feeding, "
                               "kernel choice or device layout): stop (exit 2, naming the keys) or "
                               "continue (earlier configs kept in config_history/)",
                               choices=("stop", "continue")),
        "format": _f("str", "npz", "file format of the final parameters", choices=("npz", "safetensors")),
    }),
    "precision": {
        "policy": _f("str", "fp32", "preset (fp32, bf16, bf16_params, fp16) or 'p=f32,c=bf16,o=f32'", low=1),
        "loss_scale": _f("str", "auto", "loss scaling; auto = what the policy needs (dynamic for fp16, "
                          "none otherwise)", choices=("auto", "none", "static", "dynamic")),
        "loss_scale_init": _f("float", 2.0 ** 15, "initial (or static) loss scale", rules=(_scale_in_bounds,),
                              **_POS_FLOAT),
        "growth_interval": _f("int", 2000, "dynamic: finite steps before the scale grows", **_POS_INT),
        "growth_factor": _f("float", 2.0, "dynamic: scale multiplier after growth_interval finite steps",
                            low=1.0, open_low=True),
        "backoff_factor": _f("float", 0.5, "dynamic: scale multiplier after a non-finite step",
                             low=0.0, high=1.0, open_low=True, open_high=True),
        "min_scale": _f("float", 1.0, "dynamic: lower bound of the scale", **_POS_FLOAT),
        "max_scale": _f("float", 2.0 ** 24, "dynamic: upper bound of the scale", **_POS_FLOAT),
        "matmul_precision": _f("str", "default", "jax_default_matmul_precision",
                               choices=("default", "high", "highest")),
        "overrides": _f("dict", {}, "per layer kind policy, e.g. {batch_norm: f32}",
                        item=_f("str", None, "policy", low=1)),
    },
    "mesh": _not_training({
        "data": _f("int", -1, "devices on the data axis; -1 = all devices left over", extra=(-1,), **_POS_INT),
        "model": _f("int", 1, "devices on the model axis", **_POS_INT),
        "pipe": _f("int", 1, "pipeline stages: devices on the pipe axis", **_POS_INT),
        "spatial": _f("int", 1, "spatial shards of each image: devices on the spatial axis", **_POS_INT),
        "order": _f("list", None, "device layout: the axes in the order the devices (process by process) "
                    "fill them, outermost first, the rest following as data, pipe, spatial, model; "
                    "null = that order; [pipe] spreads pipeline stages over the processes",
                    nullable=True, item=_f("str", None, "mesh axis", choices=("data", "pipe", "spatial", "model"))),
    }),
    "parallel": {
        # strategy, fsdp, rules and the pipeline's split, balance, schedule, remat and engine place
        # the same computation on the devices (remat computes part of it again): not training keys.
        "strategy": _f("str", "shard_map", "how the step is distributed", choices=("shard_map", "pmap", "jit"),
                       trains=False),
        "sync_batch_norm": _f("bool", True, "BatchNorm statistics over the global batch, not per device"),
        "fsdp": _f("bool", False, "shard parameters and optimiser state over the data axis", trains=False),
        "rules": _f("dict", {}, "logical parameter axis -> mesh axis (data, model) or null; "
                    "merged over the built-in rules",
                    item=_f("str", None, "mesh axis", nullable=True, choices=("data", "model")), trains=False),
        "pipeline": {
            "microbatches": _f("int", None, "micro-batches per step of each data shard: the GPipe "
                               "schedule's with mesh.pipe > 1 (required there), gradient accumulation "
                               "without; null = train.accumulate_steps", nullable=True, **_POS_INT),
            "split": _f("list", None, "mesh.pipe > 1: blocks per stage; null = balanced",
                        nullable=True, item=_f("int", None, "blocks", **_POS_INT), trains=False),
            "balance": _f("str", "macs", "mesh.pipe > 1: what a balanced split evens out (MACs: time; "
                          "activations: activation memory; memory: the estimated per-device bytes, "
                          "activations, parameters and the widest stage boundary together)",
                          choices=("macs", "params", "activations", "memory"), trains=False),
            "schedule": _f("str", "gpipe", "mesh.pipe > 1: gpipe (every forward, then every backward) or "
                           "1f1b (one forward, one backward: the same numbers, min(pipe, microbatches) "
                           "stage inputs kept per device instead of microbatches)", choices=("gpipe", "1f1b"),
                           trains=False),
            "remat": _f("bool", False, "mesh.pipe > 1: the backward keeps only each unit's input of a "
                        "stage (a block, or a run of single-layer blocks such as ResNet's stem) and "
                        "recomputes the unit once more (less activation memory, one more forward of "
                        "the stage)", trains=False),
            "engine": _f("str", "auto", "mesh.pipe > 1: spmd (one program every device runs: buffers "
                         "sized by the widest boundary and largest stage on every device; across "
                         "processes), mpmd (one program per stage, driven from Python in the "
                         "schedule's order: each device holds its own stage's buffers and runs its "
                         "own stage only; one process) or auto (mpmd in one process, spmd across "
                         "processes)", choices=("auto", "spmd", "mpmd"), trains=False),
        },
        "spatial": _not_training({
            "until": _f("str", "auto", "with mesh.spatial > 1: the last layer (a path such as layer3) whose "
                        "activations stay split along height; auto = as far as the model allows", low=1),
            "remat": _f("bool", False, "with mesh.spatial > 1: the backward keeps only each block's input "
                        "and computes the block again (less activation memory, one more forward of the "
                        "model)"),
            "halo": _f("str", "partitioner", "with mesh.spatial > 1: who brings each window's rows from "
                       "the neighbouring shards: partitioner (XLA's SPMD partitioner, under jit) or "
                       "explicit (each split block in shard_map, rows by ppermute; also splits windows "
                       "taller than their input and composes with mesh.model)",
                       choices=("partitioner", "explicit")),
        }),
    },
    "distributed": _not_training({
        "mode": _f("str", "auto", "jax.distributed.initialize: auto-detect, always, or never",
                   choices=("auto", "on", "off")),
        "coordinator_address": _f("str", None, "'host:port' of process 0; null = auto-detect",
                                  nullable=True, low=1, rules=(_host_and_port,)),
        "num_processes": _f("int", None, "number of processes; null = auto-detect", nullable=True, **_POS_INT),
        "process_id": _f("int", None, "this process's index; null = auto-detect", nullable=True, low=0,
                         rules=(_process_in_range,)),
        "timeout_s": _f("float", 300.0, "seconds to wait for the other processes", **_POS_FLOAT),
    }),
    "logging": _not_training({
        "log_every": _f("duration", 50, "print and record training metrics this often", low=0, open_low=True),
        "progress": _f("str", "auto", "progress display: auto = bar on a terminal, lines otherwise",
                       choices=("auto", "bar", "lines", "none")),
        "tensorboard": _f("bool", False, "also write TensorBoard event files"),
        "workdir": _f("str", None, "run directory (config, metrics, checkpoints); null = the trainer picks one",
                      nullable=True, low=1, path="output"),
    }),
}

# ------------------------------------------------------------------ Config

class Config(Mapping):
    """Immutable nested configuration with attribute and item access.

    ``cfg.optim.lr``, ``cfg["optim"]["lr"]`` and ``**cfg.model.options`` all
    work; lists are stored as tuples.  Compares equal to an equal ``Config``;
    hashable.
    """

    __slots__ = ("_data", "_path")

    def __init__(self, data: Mapping, path: str = ""):
        frozen = {k: _freeze(v, _join(path, k)) for k, v in data.items()}
        object.__setattr__(self, "_data", frozen)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._data[name]
        except KeyError:
            hint = _suggest(name, list(self._data))
            raise AttributeError(f"config {self._path or 'root'!r} has no key {name!r}{hint}") from None

    def __setattr__(self, name, value):
        raise AttributeError("Config is immutable; use with_overrides(cfg, ['key=value'])")

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def __hash__(self):
        return hash(tuple(self._data.items()))

    def __repr__(self):
        return f"Config({to_dict(self)!r})"

    def __reduce__(self):
        return (Config, (to_dict(self), self._path))


def _freeze(value, path):
    if isinstance(value, Mapping):
        return Config(value, path)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, path) for v in value)
    return value


def to_dict(cfg) -> Any:
    """Plain ``dict``/``list``/scalar copy of a :class:`Config` (or any value
    inside one), ready for ``yaml.safe_dump``."""
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


# ----------------------------------------------------------------- loading

def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """Load, merge, override and validate a run configuration.

    Arguments:
        path: YAML file; may name ``base:`` files to merge under it.
        overrides: ``"dotted.key=value"`` strings applied after all files, in
            order (see :func:`parse_overrides`).

    Returns:
        The validated :class:`Config`, every key of :data:`SCHEMA` present.

    Raises:
        ConfigError: unreadable or malformed file, base cycle, bad override or
            any schema violation; the message names key, value and source.
    """
    sources: dict[str, str] = {}
    raw = _load_file(os.fspath(path), sources, ())
    _apply_overrides(raw, overrides, sources)
    return _validate(raw, sources, default_source=os.fspath(path))


def config_from_dict(data: Mapping, overrides: Sequence[str] = (), *, source: str | None = None) -> Config:
    """Validate a plain nested dict (e.g. a checkpoint's resolved config).

    Arguments:
        data: nested mapping in the YAML layout; ``base`` is not allowed.
        overrides: ``"dotted.key=value"`` strings applied on top.
        source: name used in error messages (default ``"<dict>"``).
    """
    source = source or "<dict>"
    if not isinstance(data, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}", source=source)
    if "base" in data:
        raise ConfigError("'base' includes are only supported in files", path="base", source=source)
    raw = _augment_spellings(_copy(data), "", source)
    sources: dict[str, str] = {}
    _record_sources(raw, "", source, sources)
    _apply_overrides(raw, overrides, sources)
    return _validate(raw, sources, default_source=source)


def with_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """A new validated config: ``cfg`` with ``"dotted.key=value"`` overrides applied."""
    return config_from_dict(to_dict(cfg), overrides, source="<config>")


def _copy(value):
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


# ------------------------------------------------------------------- YAML

# YAML 1.1 (PyYAML) reads unquoted yes/no/on/off as booleans. A key whose value is one of a few
# words must see the word that was typed: `checkpoint.resume: yes` is not a valid choice (and
# must not pass as `true`), while `distributed.mode: on` is. So the loader keeps these four words
# (any case) as a `_Word`, a str that also carries YAML 1.1's boolean; validation gives bool keys
# (and free-form data such as model.options) the boolean and string keys the word. `true`/`false`
# stay booleans.
class _Word(str):
    """An unquoted yes/no/on/off from a YAML file or override: the text, plus YAML 1.1's bool."""

    __slots__ = ()

    @property
    def boolean(self) -> bool:
        return self.lower() in ("yes", "on")


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (same tags, same safety) that keeps yes/no/on/off as :class:`_Word`."""

    def construct_yaml_bool(self, node):
        value = super().construct_yaml_bool(node)
        if node.style is None and node.value.lower() in ("yes", "no", "on", "off"):
            return _Word(node.value)
        return value


_ConfigLoader.add_constructor("tag:yaml.org,2002:bool", _ConfigLoader.construct_yaml_bool)


def _yaml_load(text: str, where: str):
    """``yaml.safe_load`` semantics with :class:`_ConfigLoader`, refusing a mapping that names a
    key twice (PyYAML keeps the last one silently) with a ConfigError naming key and lines."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_duplicate_keys(root, where: str):
    seen_nodes, todo = set(), [(root, "")]
    while todo:  # iterative, each node once: aliases may share (or contain) nodes
        node, path = todo.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    todo.append((value_node, path))
                    continue
                key = _join(path, key_node.value)
                line = key_node.start_mark.line + 1
                if (key_node.tag, key_node.value) in lines:
                    raise ConfigError(f"{where}:{line}: duplicate key {key!r} (also on line "
                                      f"{lines[key_node.tag, key_node.value]}); a key may appear only "
                                      "once in a mapping", path=key)
                lines[key_node.tag, key_node.value] = line
                todo.append((value_node, key))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))


def _plain(value):
    """``value`` with every :class:`_Word` turned into YAML 1.1's boolean (free-form data)."""
    if isinstance(value, _Word):
        return value.boolean
    if isinstance(value, Mapping):
        return {str(k) if isinstance(k, _Word) else k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# A run config holds a few hundred values. These caps stop a hostile file before it is merged
# (merging copies every value): a huge file, or YAML aliases that expand a few lines into
# billions of values (the "billion laughs").
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000


def _check_expanded_size(data, where: str):
    """Raises ConfigError when ``data`` holds more than MAX_CONFIG_VALUES values once YAML aliases
    are expanded, or an alias that contains itself. Shared nodes are counted once per use but
    visited once, so the check itself stays cheap."""
    sizes, open_nodes = {}, set()

    def size(value) -> int:
        if not isinstance(value, (dict, list)):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(f"{where}: a YAML alias refers to itself")
        open_nodes.add(key)
        children = value.values() if isinstance(value, dict) else value
        total = 1 + sum(size(child) for child in children)
        open_nodes.discard(key)
        if total > MAX_CONFIG_VALUES:
            raise ConfigError(f"{where}: holds more than {MAX_CONFIG_VALUES} values once YAML aliases are "
                              "expanded; not a run config")
        sizes[key] = total
        return total

    try:
        size(data)
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply") from None


def _load_file(path: str, sources: dict, stack: tuple) -> dict:
    real = os.path.realpath(path)
    if real in stack:
        chain = " -> ".join(os.path.relpath(p) for p in stack + (real,))
        raise ConfigError(f"base include cycle: {chain}", path="base", source=path)
    where = f" (included from {os.path.relpath(stack[-1])})" if stack else ""
    try:
        # Non-blocking open, then only a regular file is read: opening a FIFO for reading would
        # wait for a writer forever, and a device (/dev/zero) is no config either.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                        else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode)
                        or stat.S_ISBLK(mode) else "not a regular file")
                raise ConfigError(f"cannot read config file {path!r}{where}: it is {kind}, not a regular file")
            f = open(fd, encoding="utf-8", closefd=True)
        except BaseException:
            os.close(fd)
            raise
        with f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}{where}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path!r} is larger than {MAX_CONFIG_BYTES} characters; "
                          "not a run config")
    try:
        data = _yaml_load(text, path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path}{at}: YAML syntax error: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply") from None
    _check_expanded_size(data, path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping of sections, got {type(data).__name__}", source=path)
    bases = data.pop("base", None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"base: expected a file name or a list of file names, got {bases!r}",
                          path="base", source=path)
    merged: dict = {}
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), os.path.expanduser(base))
        _merge(merged, _load_file(base_path, sources, stack + (real,)), sources, None)
    _merge(merged, data, sources, path)
    return merged


def _record_sources(tree, prefix, source, sources):
    for key, value in tree.items():
        path = _join(prefix, str(key))
        sources[path] = source
        if isinstance(value, dict):
            _record_sources(value, path, source, sources)


def _merge(lower: dict, upper: dict, sources: dict, source: str | None, prefix: str = ""):
    """Deep-merge ``upper`` into ``lower`` in place: mappings merge, anything
    else replaces.  ``source`` (when not None) is recorded for upper's keys."""
    upper = _augment_spellings(upper, prefix, source)
    for key, value in upper.items():
        path = _join(prefix, str(key))
        spec = schema_field(path)
        other = spec.clears.rpartition(".")[2] if spec is not None and spec.clears else None
        if other is not None and value is not None and other not in upper:
            lower.pop(other, None)
        if source is not None:
            sources[path] = source
        none = path == "data.augment" and _says_none(value)  # the whole section, replaced
        if none:
            value = {"no_aug": True}
        if isinstance(value, dict) and isinstance(lower.get(key), dict) and not none:
            _merge(lower[key], value, sources, source, path)
        else:
            lower[key] = _copy(value)
            if source is not None and isinstance(value, dict):
                _record_sources(value, path, source, sources)


# --------------------------------------------------------------- overrides

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """Parse ``"dotted.key=value"`` strings.

    The value is read with ``yaml.safe_load``: ``3`` is an int, ``1.0e-3``/``1e-3``
    a float (float keys accept both), ``true`` a bool, ``[30, 60]`` a list,
    ``{cifar_stem: true}`` a mapping, an empty value null; anything else a string.

    Arguments:
        overrides: the strings, e.g. ``["train.steps=100", "optim.name=sgd"]``.

    Returns:
        ``[(dotted_key, value), ...]`` in the given order (later ones win).

    Raises:
        ConfigError: missing ``=``, malformed key or unparsable value.
    """
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of strings, got the string {overrides!r}")
    # Plain YAML 1.1 values (yes/no/on/off as booleans); validation itself sees the typed word.
    return [(key, _plain(value)) for key, value in map(_parse_override, overrides)]


def _parse_override(text) -> tuple[str, Any]:
    if not isinstance(text, str):
        raise ConfigError(f"override must be a string 'key=value', got {text!r}")
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"override {text!r}: expected 'dotted.key=value' (no '=' found)")
    if not _KEY_RE.match(key):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted key like 'optim.lr'")
    if key == "base" or key.startswith("base."):
        raise ConfigError(f"override {text!r}: 'base' can only be set inside a config file")
    try:
        value = _yaml_load(value_text, f"override {text!r}")
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"override {text!r}: cannot parse value {value_text!r} as YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"override {text!r}: value nested too deeply") from None
    _check_expanded_size(value, f"override {text!r}")
    return key, value


def _apply_overrides(raw: dict, overrides: Sequence[str], sources: dict):
    for text in overrides:
        key, value = _parse_override(text)
        source = f"override {text!r}"
        parts = key.split(".")
        node, prefix = raw, ""
        for part in parts[:-1]:
            prefix = _join(prefix, part)
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"{key}: cannot set a key inside {prefix}, which is {_short(child)}, "
                                  "not a mapping", path=key, source=source)
            node = child
        _merge(node, {parts[-1]: value}, sources, source, ".".join(parts[:-1]))


# -------------------------------------------------------------- validation

def _validate(raw: dict, sources: dict, default_source: str) -> Config:
    def source_of(path):
        path = re.sub(r"\[\d+\]", "", path)  # list items come from their list's source
        probe = path
        while probe:
            if probe in sources:
                return sources[probe]
            probe = probe.rpartition(".")[0]
        under = [s for p, s in sources.items() if p.startswith(path + ".")]
        return under[0] if under else default_source

    _read_augment_shorthands(raw, source_of)
    resolved = _validate_section(raw, SCHEMA, "", source_of)
    _expand_home(resolved)
    _check_rules(resolved, source_of)
    return Config(resolved)


def _read_augment_shorthands(raw: dict, source_of) -> None:
    """In place: ``data.augment: none`` is ``{no_aug: true}`` (`_merge` reads it so too, so that
    a later layer or override may add ``interpolation``)."""
    data = raw.get("data")
    augment = data.get("augment") if isinstance(data, dict) else None
    if augment is not None and not isinstance(augment, dict):
        if not _says_none(augment):
            raise ConfigError(f"data.augment: expected a mapping of keys or 'none' (no augmentation at all), "
                              f"got {_short(augment)}", path="data.augment", source=source_of("data.augment"))
        data["augment"] = {"no_aug": True}


def _augment_spellings(layer: dict, prefix: str, source) -> dict:
    """``layer`` (one file, override or recorded config, at dotted ``prefix``) with
    ``data.augment``'s other spellings read as the schema's: a number ``v`` for ``color_jitter``
    (timm's form) as ``[v, v, v]``, and the key ``flip``, which ``hflip`` replaced and run
    directories recorded, as ``hflip: 0.5`` when true and as ``hflip: null`` (the source's recipe,
    the same as before: none for arrays, and image files ignored flip) when false. Each layer is
    read so before it is merged, so that a later one overrides it as it overrode flip."""
    inner = {"": ("data", "augment"), "data": ("augment",), "data.augment": ()}.get(prefix)
    node = layer
    for part in inner or ():
        node = node.get(part) if isinstance(node, dict) else None
    if inner is None or not isinstance(node, dict) or not {"flip", "color_jitter"} & set(node):
        return layer
    layer = _copy(layer)
    node = layer
    for part in inner:
        node = node[part]
    jitter = node.get("color_jitter")
    if isinstance(jitter, (int, float)) and not isinstance(jitter, bool):
        node["color_jitter"] = [jitter] * 3
    if "flip" not in node:
        return layer
    flip = node.pop("flip")
    flip = flip.boolean if isinstance(flip, _Word) else flip
    if not isinstance(flip, bool):
        raise ConfigError(f"data.augment.flip: expected a bool (true/false), got {_short(flip)} (flip is the old "
                          "name of data.augment.hflip: true = 0.5)", path="data.augment.flip", source=source)
    if flip and node.get("hflip") is not None:
        raise ConfigError(f"data.augment.flip: true and data.augment.hflip={node['hflip']!r} are both set; flip "
                          "is hflip's old name (true = 0.5): keep hflip", path="data.augment.flip", source=source)
    node.setdefault("hflip", 0.5 if flip else None)
    return layer


def _says_none(value) -> bool:
    """Whether ``value`` is the word ``none`` (any case), as ``data.augment: none`` gives it."""
    return isinstance(value, str) and not isinstance(value, _Word) and value.lower() == "none"


def _renamed_keys(flat: dict) -> dict:
    """A flattened config of an older jaxcnn with its renamed keys read as
    :func:`_flip_as_hflip` reads them (``data.augment.flip``)."""
    if "data.augment.flip" not in flat:
        return flat
    flat = dict(flat)
    if flat.pop("data.augment.flip") is True and flat.get("data.augment.hflip") is None:
        flat["data.augment.hflip"] = 0.5
    return flat


def _expand_home(resolved: dict) -> None:
    """A leading ``~`` of a path key is the home directory, as a shell would take it (a config
    file's ``path: ~/data/cifar-10-batches-bin`` was "does not exist")."""
    for key in path_keys():
        *sections, name = key.split(".")
        node = resolved
        for part in sections:
            node = node[part]
        if isinstance(node[name], str) and node[name].startswith("~"):
            node[name] = os.path.expanduser(node[name])


def _check_rules(resolved: dict, source_of) -> None:
    """Each field's rules across keys, in schema order: the first problem is a ConfigError
    naming the field's key."""
    for key, spec in fields():
        for rule in spec.rules:
            problem = rule(_get(resolved, key), resolved)
            if problem:
                raise ConfigError(f"{key}: {problem}", path=key, source=source_of(key))


def _validate_section(raw, schema: dict, prefix: str, source_of) -> dict:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix}: expected a mapping of keys, got {_short(raw)}",
                          path=prefix, source=source_of(prefix))
    for key in raw:
        if key not in schema:
            path = _join(prefix, str(key))
            raise ConfigError(f"unknown {'key' if prefix else 'section'} {path!r}{_suggest_path(str(key), prefix)}",
                              path=path, source=source_of(path))
    out = {}
    for key, spec in schema.items():
        path = _join(prefix, key)
        if isinstance(spec, dict):
            out[key] = _validate_section(raw.get(key), spec, path, source_of)
        elif key in raw:
            out[key] = _check(spec, raw[key], path, source_of)
        elif spec.required:
            raise ConfigError(f"{path}: missing required key ({spec.doc})", path=path, source=source_of(path))
        else:
            out[key] = _copy(spec.default)
    return out


_FLOAT_TEXT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_DURATION_TEXT = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(ep|epoch|epochs|st|step|steps)\s*$")



def _check(spec: Field, value, path: str, source_of):
    def fail(problem=None):
        message = problem or f"expected {_expected(spec)}, got {_short(value)}"
        raise ConfigError(f"{path}: {message}", path=path, source=source_of(path))

    if value is None:
        if spec.nullable:
            return None
        fail(f"missing required key ({spec.doc})" if spec.required else None)
    kind = spec.type
    if isinstance(value, _Word):  # unquoted yes/no/on/off: see _ConfigLoader
        if kind == "bool":
            value = value.boolean
        elif kind == "str":
            word = str(value)
            value = word.lower() if word.lower() in spec.choices else word
        elif kind != "dict":
            fail()
    if kind == "int":
        # bool is an int subclass in Python; `true` must not pass as 1.
        if not isinstance(value, int) or isinstance(value, bool):
            fail()
    elif kind == "float":
        # YAML 1.1 reads 1e-3 (no dot) as a string; accept that spelling.
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            fail()
        if isinstance(value, int) and abs(value) > _MAX_FLOAT_INT:  # float() would overflow
            fail()
        if not math.isfinite(value):
            fail()
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            fail()
    elif kind == "str":
        if isinstance(value, bool):  # `true`/`false`: never one of the words a key accepts
            fail(f"expected {_expected(spec)}, got {str(value).lower()} (a boolean)")
        if not isinstance(value, str):
            fail()
    elif kind == "duration":
        value = _parse_duration(value, fail)
    elif kind == "list":
        if not isinstance(value, (list, tuple)):
            scalar = isinstance(value, (str, int, float)) and not isinstance(value, bool)
            hint = spec.example or (f"{path}=[{value}]" if scalar else None)
            fail(f"expected {_expected(spec)}, got {_short(value)}"
                 + (f"; write it in brackets, e.g. {hint}" if hint else ""))
        if spec.length is not None and len(value) != spec.length:
            fail(f"expected a list of {spec.length} items, got {_short(value)}")
        return [_check(spec.item, v, f"{path}[{i}]", source_of) for i, v in enumerate(value)]
    elif kind == "dict":
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            fail("expected a mapping with string keys, got " + _short(value))
        if spec.item is None:
            return _plain(value)
        return {k: _check(spec.item, v, _join(path, k), source_of) for k, v in value.items()}
    else:  # pragma: no cover - schema typo
        raise AssertionError(f"bad schema type {kind!r} for {path}")

    if spec.choices and value not in spec.choices:
        fail(f"expected {_expected(spec)}, got {_short(value)}"
             + _suggest(str(value), [str(c) for c in spec.choices]))
    if value in spec.extra:
        return value
    amount = value
    if kind == "duration":
        amount = value if isinstance(value, int) else float(value[:-2])
    elif kind == "str":
        amount = len(value)
    if not _in_range(spec, amount):
        fail()
    return value


def _high(spec: Field):
    """Upper bound of a number: the schema's, else MAX_INT for ints and step durations."""
    if spec.high is None and spec.type in ("int", "duration"):
        return MAX_INT
    return spec.high


def _in_range(spec: Field, x) -> bool:
    high = _high(spec)
    if spec.low is not None and (x < spec.low or (spec.open_low and x == spec.low)):
        return False
    if high is not None and (x > high or (spec.open_high and x == high)):
        return False
    return True


def _parse_duration(value, fail):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and not isinstance(value, _Word):
        m = _DURATION_TEXT.match(value)
        if m:
            number, unit = m.groups()
            amount = float(number)
            if not math.isfinite(amount):
                fail(f"expected a finite duration, got {value!r}")
            if unit.startswith("ep"):
                return _epochs_text(amount)
            if amount.is_integer():
                return int(number) if number.isdigit() else int(amount)
            fail(f"expected a whole number of steps, got {value!r}")
    fail()


def _epochs_text(epochs: float) -> str:
    """The canonical ``"<N>ep"``: exact (``repr``), plain digits for whole numbers (1e6 epochs is
    ``"1000000ep"``), so reading it back gives the same number."""
    if epochs.is_integer() and abs(epochs) < 1e16:
        return f"{int(epochs)}ep"
    return f"{epochs!r}ep"


def _expected(spec: Field) -> str:
    if spec.type == "str":
        text = "one of " + ", ".join(map(repr, spec.choices)) if spec.choices else (
            "a non-empty string" if spec.low else "a string")
    else:
        text = {
            "int": "an int", "float": "a float", "bool": "a bool (true/false)", "dict": "a mapping",
            "duration": "a duration (int steps, '<N>st' or '<N>ep')",
            "list": f"a list of {spec.length or 'any number of'} {spec.item.type if spec.item else ''} items",
        }[spec.type]
        bounds, high = [], _high(spec)
        if spec.low is not None:
            bounds.append(f"{'>' if spec.open_low else '>='} {_number(spec.low)}")
        if high is not None:
            bounds.append(f"{'<' if spec.open_high else '<='} {_number(high)}")
        if bounds:
            text += " " + " and ".join(bounds)
        if spec.extra:
            text += " or " + " or ".join(map(repr, spec.extra))
    if spec.nullable:
        text += " or null"
    return text


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


# ------------------------------------------------------------ printing

_KEY_LINE = re.compile(r"^( *)([A-Za-z_][A-Za-z0-9_]*):(?: |$)")


def unused_keys(cfg) -> dict[str, str]:
    """``{dotted key: why}`` for the keys of ``cfg`` that its other choices leave unused, e.g.
    ``{"data.num_train": "not used by data.source=mnist"}``."""
    out = {}
    for key, spec in fields():
        if spec.used_when is not None:
            chooser, users = spec.used_when
            choice = _get(cfg, chooser)
            if choice not in users:
                out[key] = f"not used by {chooser}={choice}"
    return out


def set_but_unused(cfg) -> list[str]:
    """``"key=value (not used by chooser=choice)"`` for each key of `unused_keys` that ``cfg``
    sets away from its schema default: an option that would otherwise be dropped without a
    word (``data.image_size`` on ``npz`` data, ``optim.momentum`` under ``adam``)."""
    def plain(value):
        if isinstance(value, Config):
            value = to_dict(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    out = []
    for key, why in unused_keys(cfg).items():
        value = plain(_get(cfg, key))
        if value != plain(schema_default(key)):
            out.append(f"{key}={value!r} ({why})")
    return out


def dump_config(cfg) -> str:
    """``cfg`` as YAML (what ``jaxcnn-train --print-config`` prints), each key that the config's
    other choices leave unused marked by a comment (``# not used by data.source=mnist``). Loading
    the text gives ``cfg`` back: the comments are only comments."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, width=float("inf"))
    notes, lines, stack = unused_keys(cfg), [], []
    for line in text.splitlines():
        m = _KEY_LINE.match(line)
        if m:
            depth = len(m.group(1)) // 2
            stack[depth:] = [m.group(2)]
            note = notes.get(".".join(stack))
            if note:
                line += f"  # {note}"
        lines.append(line)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- durations

def resolve_duration(value: int | str | None, steps_per_epoch: int | None, *,
                     key: str | None = None) -> int | None:
    """Turn a duration into a number of steps.

    Arguments:
        value: int steps, ``"<N>st"``/``"<N> steps"``, ``"<N>ep"``/``"<N> epochs"``
            (N may be fractional for epochs), or None (returned unchanged).
        steps_per_epoch: optimiser steps in one epoch; needed only for epochs.
        key: the dotted config key the duration comes from; errors name it.

    Returns:
        Steps; epochs are rounded to the nearest step, at least 1 when N > 0.

    Raises:
        ConfigError: not a duration, negative, or more than MAX_STEPS steps.
    """
    if value is None:
        return None

    def fail(problem=None):
        problem = problem or f"expected a duration (int steps, '<N>st' or '<N>ep'), got {value!r}"
        raise ConfigError(f"{key}: {problem}" if key else problem, path=key or "")

    parsed = _parse_duration(value, fail)
    if isinstance(parsed, int):
        if parsed < 0:
            fail(f"a duration cannot be negative, got {value!r}")
        steps, what = parsed, repr(value)
    else:
        if (not isinstance(steps_per_epoch, int) or isinstance(steps_per_epoch, bool)
                or steps_per_epoch < 1):
            fail(f"duration {value!r} is in epochs but steps_per_epoch={steps_per_epoch!r}")
        epochs = float(parsed[:-2])
        steps = max(1, round(epochs * steps_per_epoch)) if epochs > 0 else 0
        what = f"{epochs:g} epochs of {steps_per_epoch} steps ({steps} steps)"
    if steps > MAX_STEPS:
        fail(f"{what} is more than the {MAX_STEPS} steps a run can count (the step counter is int32)")
    return steps


def train_steps(train_cfg, steps_per_epoch: int | None) -> int:
    """Total optimiser steps of the run, from ``train.steps`` or ``train.epochs``.

    Raises:
        ConfigError: naming ``train.epochs`` when the epochs come to more than MAX_STEPS steps.
    """
    if train_cfg.steps is not None:
        return train_cfg.steps
    return resolve_duration(_epochs_text(float(train_cfg.epochs)), steps_per_epoch, key="train.epochs")


# ------------------------------------------------------------ the registry

def fields(schema: dict | None = None, prefix: str = ""):
    """``(dotted key, Field)`` for every key of the schema (default :data:`SCHEMA`), in order."""
    for key, spec in (SCHEMA if schema is None else schema).items():
        if isinstance(spec, dict):
            yield from fields(spec, _join(prefix, key))
        else:
            yield _join(prefix, key), spec


def schema_field(key: str) -> Field | None:
    """The Field of dotted ``key``, or of the ``dict`` key it lies under (``model.options.x``
    is ``model.options``); None for a section or a key the schema does not have."""
    node = SCHEMA
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
        if isinstance(node, Field):
            return node
    return None


_NO_DEFAULT = object()


def schema_default(key: str):
    """The schema's default of dotted ``key`` (a leaf), or ``_NO_DEFAULT`` for a key the schema
    does not have."""
    node = SCHEMA
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _NO_DEFAULT
        node = node[part]
    return node.default if isinstance(node, Field) else _NO_DEFAULT


def path_keys(kind: str | None = None) -> tuple[str, ...]:
    """The keys whose values name files or directories (``Field.path``), or those of one kind
    (``"input"``: read again when a run is resumed or exported)."""
    return tuple(k for k, spec in fields() if spec.path and kind in (None, spec.path))


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


# -------------------------------------------- which keys change the training

def _flatten(tree: Mapping, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _trains(key: str) -> bool:
    """Whether dotted ``key`` changes what training computes. A key the schema does not know
    (one another version saved) counts, unless it lies in a section none of whose keys does
    (``logging.``, ``mesh.``...)."""
    spec = schema_field(key)
    if spec is not None:
        return spec.trains
    node, parts = SCHEMA, key.split(".")[:-1]
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
        if isinstance(node, dict) and not any(f.trains for _, f in fields(node)):
            return False
    return True


# An image folder or records run without augmentation trains on evaluation's resize and crop.
_TRAIN_ON_THE_EVAL_RESIZE = ("data.eval_resize", "data.augment.crop_pct")


def training_config(config_dict: Mapping) -> dict:
    """``{dotted key: value}`` of the keys of a resolved config whose Field ``trains``, and the
    evaluation resize's keys when training uses that resize (``data.augment: none`` on an image
    folder or records)."""
    flat = _renamed_keys(_flatten(config_dict))
    eval_resize_trains = bool(flat.get("data.augment.no_aug")) and flat.get("data.source") in _IMAGE_FILES
    return {k: v for k, v in flat.items()
            if _trains(k) or (eval_resize_trains and k in _TRAIN_ON_THE_EVAL_RESIZE)}


def config_digest(config_dict: Mapping) -> str:
    """sha256 of :func:`training_config` (canonical JSON): equal for configs that train alike."""
    text = json.dumps(training_config(config_dict), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def config_changes(old: Mapping, new: Mapping) -> list[str]:
    """``"key: old -> new"`` for each training key whose value differs, sorted by key.

    A key the old config does not have (it was saved by a jaxcnn without it) is no change when
    the new config leaves it at its default: a run resumes across a version that adds keys."""
    a, b = training_config(old), training_config(new)
    missing = "(unset)"

    def opened_up(k, x, y):  # `{}` on one side, its keys on the other: those keys say it all
        return x.get(k, missing) == {} and k not in y and any(key.startswith(k + ".") for key in y)

    return [f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}"
            for k in sorted(a.keys() | b.keys()) if a.get(k, missing) != b.get(k, missing)
            and not (k not in a and _as_saved(schema_default(k)) == b[k])
            and not opened_up(k, a, b) and not opened_up(k, b, a)]


def change_summary(changes: list[str], limit: int = 6) -> str:
    """The first ``limit`` of :func:`config_changes`' lines, joined, and how many more."""
    more = f" (and {len(changes) - limit} more)" if len(changes) > limit else ""
    return ", ".join(changes[:limit]) + more


def other_model(old: Mapping, new: Mapping) -> str | None:
    """``"model 'lenet5', not 'mnist_cnn'"`` when two configs name different models, else None."""
    a, b = training_config(old).get("model.name"), training_config(new).get("model.name")
    return None if a == b else f"model {a!r}, not {b!r}"


def _as_saved(value):
    """A schema default as a resolved config holds it (lists for tuples, plain dicts)."""
    if isinstance(value, tuple):
        return list(value)
    return value


# ----------------------------------------------------------------- helpers


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _suggest_path(key: str, prefix: str) -> str:
    """The key another library's name (a field's ``aliases``) stands for, else the same key
    in another section (it was put in the wrong place), else a close spelling in this
    section."""
    aliased, elsewhere = [], []

    def walk(schema, path):
        for k, spec in schema.items():
            if isinstance(spec, Field) and key in spec.aliases:
                aliased.append(_join(path, k))
            if k == key and path != prefix:
                elsewhere.append(_join(path, k))
            if isinstance(spec, dict):
                walk(spec, _join(path, k))

    walk(SCHEMA, "")
    if aliased or elsewhere:
        return f"; did you mean {(aliased or elsewhere)[0]!r}?"
    node = SCHEMA
    for part in prefix.split(".") if prefix else ():
        node = node[part]
    close = difflib.get_close_matches(key, list(node), n=1, cutoff=0.6)
    return f"; did you mean {_join(prefix, close[0])!r}?" if close else ""
