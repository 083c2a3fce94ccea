"""Tests of jaxcnn.train.config: loading, includes, overrides, validation, durations."""
import glob
import os
import pickle
import textwrap

import pytest
import yaml

from jaxcnn.train.config import (
    SCHEMA, Config, ConfigError, config_from_dict, describe_schema, load_config, parse_overrides,
    resolve_duration, to_dict, train_steps, with_overrides)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINIMAL = {"model": {"name": "mnist_cnn"}, "train": {"steps": 10}}


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, "errors must be one line"
    return info.value


def schema_leaves(schema=SCHEMA, prefix=""):
    for key, spec in schema.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(spec, dict):
            yield from schema_leaves(spec, path)
        else:
            yield path, spec


# ------------------------------------------------------------ happy paths

def test_defaults_fill_every_schema_key(tmp_path):
    cfg = load_config(write(tmp_path, "a.yaml", "model: {name: mnist_cnn}\ntrain: {epochs: 2}\n"))
    for path, spec in schema_leaves():
        node = cfg
        for part in path.split("."):
            node = node[part]
        if path == "model.name":
            assert node == "mnist_cnn"
        elif path == "train.epochs":
            assert node == 2.0 and isinstance(node, float)  # int accepted where float expected
        elif isinstance(spec.default, list):
            assert node == tuple(spec.default)
        elif isinstance(spec.default, dict):
            assert to_dict(node) == spec.default
        else:
            assert node == spec.default, path
    assert cfg.optim.schedule.name == "constant"
    assert cfg.data.augment.crop_padding == 0


def test_config_is_immutable_mapping_with_attribute_access():
    cfg = config_from_dict({**MINIMAL, "model": {"name": "resnet18", "options": {"cifar_stem": True}}})
    assert cfg.model.options == Config({"cifar_stem": True})
    assert dict(**cfg.model.options) == {"cifar_stem": True}  # usable as **kwargs
    assert cfg["optim"]["lr"] == cfg.optim.lr
    with pytest.raises(AttributeError, match="immutable"):
        cfg.optim.lr = 1.0
    with pytest.raises(AttributeError, match="did you mean 'lr'"):
        cfg.optim.lrr
    assert hash(cfg) == hash(config_from_dict(to_dict(cfg)))
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_base_include_nested_relative_paths_and_precedence(tmp_path):
    write(tmp_path, "base/common.yaml", """
        data: {batch_size: 64, augment: {flip: true}}
        optim: {name: sgd, lr: 0.5, momentum: 0.8}
        train: {epochs: 3}
    """)
    write(tmp_path, "base/sgd.yaml", """
        base: common.yaml          # relative to base/
        optim: {lr: 0.2, nesterov: true}
    """)
    top = write(tmp_path, "run.yaml", """
        base: base/sgd.yaml
        model: {name: resnet18}
        optim: {lr: 0.1}
        data: {augment: {crop_padding: 4}}
    """)
    cfg = load_config(top)
    assert cfg.optim.lr == 0.1                 # top file beats its bases
    assert cfg.optim.nesterov is True          # from the middle file
    assert cfg.optim.momentum == 0.8           # from the innermost base
    assert cfg.data.augment.flip is True and cfg.data.augment.crop_padding == 4  # deep merge
    assert cfg.train.epochs == 3.0
    cfg = load_config(top, ["optim.lr=0.05", "optim.lr=0.01", "data.batch_size=32"])
    assert cfg.optim.lr == 0.01 and cfg.data.batch_size == 32  # overrides last, in order


def test_list_of_bases_applied_in_order(tmp_path):
    write(tmp_path, "one.yaml", "optim: {lr: 0.1, b1: 0.5}\n")
    write(tmp_path, "two.yaml", "optim: {lr: 0.2}\n")
    cfg = load_config(write(tmp_path, "run.yaml", "base: [one.yaml, two.yaml]\nmodel: {name: m}\n"
                                                  "train: {steps: 1}\n"))
    assert cfg.optim.lr == 0.2 and cfg.optim.b1 == 0.5


def test_steps_and_epochs_later_layer_wins(tmp_path):
    write(tmp_path, "base.yaml", "model: {name: m}\ntrain: {epochs: 3}\n")
    run = write(tmp_path, "run.yaml", "base: base.yaml\ntrain: {steps: 100}\n")
    cfg = load_config(run)
    assert (cfg.train.steps, cfg.train.epochs) == (100, None)
    cfg = load_config(run, ["train.epochs=0.5"])
    assert (cfg.train.steps, cfg.train.epochs) == (None, 0.5)
    assert train_steps(cfg.train, steps_per_epoch=62) == 31
    assert train_steps(load_config(run).train, steps_per_epoch=62) == 100
    both = write(tmp_path, "both.yaml", "model: {name: m}\ntrain: {steps: 1, epochs: 1}\n")
    err = error_of(load_config, both)
    assert "exactly one of train.steps or train.epochs" in str(err)
    err = error_of(load_config, write(tmp_path, "none.yaml", "model: {name: m}\n"))
    assert "exactly one" in str(err) and err.path == "train.steps"


def test_override_value_parsing():
    assert parse_overrides(["train.steps=100", "optim.name=adamw", "mesh.data=-1",
                            "optim.schedule.milestones=[30, 60]", "data.path=", "a.b=x=y",
                            "model.options={cifar_stem: true}", "optim.nesterov=true", "x= 1.5 "]) == [
        ("train.steps", 100), ("optim.name", "adamw"), ("mesh.data", -1),
        ("optim.schedule.milestones", [30, 60]), ("data.path", None), ("a.b", "x=y"),
        ("model.options", {"cifar_stem": True}), ("optim.nesterov", True), ("x", 1.5)]


def test_overrides_reach_nested_and_free_form_keys(tmp_path):
    cfg = config_from_dict(MINIMAL, ["model.options.cifar_stem=true", "optim.lr=1e-3",
                                     "optim.schedule.name=multistep", "optim.schedule.milestones=[2ep, 300]",
                                     "parallel.rules={out: model, in: null}", "mesh.data=-1",
                                     "distributed.mode=off", "precision.overrides.batch_norm=f32"])
    assert cfg.model.options.cifar_stem is True
    assert cfg.optim.lr == 1e-3                # YAML reads 1e-3 as a string; float keys accept it
    assert cfg.optim.schedule.milestones == ("2ep", 300)
    assert to_dict(cfg.parallel.rules) == {"out": "model", "in": None}
    assert cfg.distributed.mode == "off"       # YAML 1.1 reads bare off as false
    assert cfg.precision.overrides.batch_norm == "f32"
    assert with_overrides(cfg, ["optim.lr=0.5"]).optim.lr == 0.5


def test_resolved_config_round_trip(tmp_path):
    path = os.path.join(REPO, "configs", "resnet18_cifar10.yaml")
    cfg = load_config(path, ["optim.schedule.warmup=0.5 epochs", "optim.schedule.milestones=[100st, 1ep]",
                             "data.image_size=[32, 32, 3]"])
    assert cfg.optim.schedule.warmup == "0.5ep" and cfg.optim.schedule.milestones == (100, "1ep")
    dumped = tmp_path / "config.resolved.yaml"
    dumped.write_text(yaml.safe_dump(to_dict(cfg)))
    again = load_config(str(dumped))
    assert again == cfg
    assert to_dict(again) == to_dict(cfg)
    assert "base" not in yaml.safe_load(dumped.read_text())


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)))
def test_every_shipped_config_validates(path):
    if os.sep + "base" + os.sep in path:
        # Bases are fragments; they must validate once a model and a duration are supplied.
        data = yaml.safe_load(open(path))
        assert isinstance(data, dict) and set(data) <= set(SCHEMA) | {"base"}
        cfg = load_config(path, ["model.name=probe", "train.steps=1", "train.epochs="]
                          + (["data.path=x"] if data.get("data", {}).get("source") in ("cifar10", "npz") else []))
    else:
        cfg = load_config(path)
        assert cfg.model.name
    assert isinstance(cfg, Config)


def test_describe_schema_lists_every_key():
    text = describe_schema()
    lines = text.splitlines()
    assert len(lines) == len(list(schema_leaves()))
    assert any(line.startswith("optim.schedule.warmup: a duration") for line in lines)
    assert "model.name: a non-empty string = (required)" in text


# ----------------------------------------------------------------- errors

def test_unknown_key_with_suggestion_and_file(tmp_path):
    path = write(tmp_path, "a.yaml", "model: {name: m}\ntrain: {steps: 1}\noptim: {learnig_rate: 0.1, lrr: 1}\n")
    err = error_of(load_config, path)
    assert "unknown key 'optim.learnig_rate'" in str(err) and path in str(err)
    assert err.path == "optim.learnig_rate" and err.source == path
    err = error_of(config_from_dict, {**MINIMAL, "optim": {"lrr": 0.1}})
    assert "did you mean 'optim.lr'?" in str(err)


def test_unknown_key_in_another_section_is_pointed_at():
    err = error_of(config_from_dict, {**MINIMAL, "train": {"steps": 1, "log_every": 5}})
    assert "unknown key 'train.log_every'" in str(err) and "did you mean 'logging.log_every'?" in str(err)


def test_unknown_section():
    err = error_of(config_from_dict, {**MINIMAL, "optimizer": {"lr": 0.1}})
    assert "unknown section 'optimizer'" in str(err) and "did you mean 'optim'?" in str(err)


@pytest.mark.parametrize("override, path, fragment", [
    ("optim.lr=fast", "optim.lr", "expected a float > 0, got 'fast'"),
    ("data.batch_size=12.5", "data.batch_size", "expected an int >= 1, got 12.5"),
    ("data.augment.flip=1", "data.augment.flip", "expected a bool (true/false), got 1"),
    ("model.options=[1]", "model.options", "expected a mapping"),
    ("data.image_size=[32, 32]", "data.image_size", "expected a list of 3 items"),
    ("data.image_size=[32, x, 3]", "data.image_size[1]", "expected an int >= 1, got 'x'"),
    ("optim.schedule.warmup=3 days", "optim.schedule.warmup", "expected a duration"),
    ("optim.schedule.warmup=1.5st", "optim.schedule.warmup", "whole number of steps"),
    ("optim.lr=.inf", "optim.lr", "expected a float > 0, got inf"),
    ("data=5", "data", "expected a mapping of keys, got 5"),
])
def test_wrong_type(override, path, fragment):
    err = error_of(config_from_dict, MINIMAL, [override])
    assert str(err).startswith(path + ":") and fragment in str(err), str(err)
    assert err.path == path and f"override {override!r}" in str(err)


@pytest.mark.parametrize("override", ["data.batch_size=true", "train.seed=false", "optim.lr=true"])
def test_bool_is_not_a_number(override):
    err = error_of(config_from_dict, MINIMAL, [override])
    assert "got True" in str(err) or "got False" in str(err)


@pytest.mark.parametrize("override, fragment", [
    ("optim.lr=0", "expected a float > 0, got 0.0"),
    ("optim.lr=-1e-3", "expected a float > 0, got -0.001"),
    ("optim.momentum=1.0", "expected a float >= 0 and < 1, got 1.0"),
    ("data.batch_size=0", "expected an int >= 1, got 0"),
    ("mesh.data=0", "expected an int >= 1 or -1, got 0"),
    ("mesh.data=-2", "expected an int >= 1 or -1, got -2"),
    ("checkpoint.keep=0", "expected an int >= 1"),
    ("optim.schedule.warmup=-5", "expected a duration (int steps, '<N>st' or '<N>ep') >= 0, got -5"),
    ("checkpoint.every=0ep", "> 0, got '0ep'"),
    ("precision.policy=", "expected a non-empty string, got None"),
    ("precision.backoff_factor=1", "expected a float > 0 and < 1"),
])
def test_out_of_range(override, fragment):
    err = error_of(config_from_dict, MINIMAL, [override])
    assert fragment in str(err), str(err)


@pytest.mark.parametrize("override, fragment", [
    ("optim.name=adamww", "expected one of 'sgd', 'adam', 'adamw', 'lars', 'lamb', got 'adamww'; "
                          "did you mean 'adamw'?"),
    ("optim.schedule.name=cosin", "did you mean 'cosine'?"),
    ("optim.mu_dtype=fp8", "expected one of 'bf16', 'f32' or null"),
    ("parallel.rules={out: tensor}", "parallel.rules.out: expected one of 'data', 'model' or null"),
    ("data.source=imagenet", "got 'imagenet'"),
    ("model.impl=cudnn", "model.impl: expected one of 'auto', 'xla', 'pallas', got 'cudnn'"),
    ("model.batch_norm_grad=closed", "did you mean 'closed_form'?"),
])
def test_bad_choice(override, fragment):
    assert fragment in str(error_of(config_from_dict, MINIMAL, [override]))


def test_missing_required(tmp_path):
    path = write(tmp_path, "a.yaml", "train: {steps: 3}\n")
    err = error_of(load_config, path)
    assert str(err).startswith("model.name: missing required key") and path in str(err)
    err = error_of(config_from_dict, MINIMAL, ["model.name="])
    assert "model.name: missing required key" in str(err)


@pytest.mark.parametrize("overrides, path, fragment", [
    (["data.source=cifar10"], "data.path", "needs data.path"),
    (["data.num_classes=100", "model.num_classes=10"], "data.num_classes", "do not fit"),
    (["optim.schedule.name=step"], "optim.schedule.decay_every", "needs decay_every"),
    (["optim.schedule.name=multistep"], "optim.schedule.milestones", "non-empty"),
    (["optim.schedule.name=onecycle", "optim.schedule.warmup=1ep"], "optim.schedule.warmup", "onecycle"),
    (["optim.name=sgd", "optim.momentum=0", "optim.nesterov=true"], "optim.nesterov", "momentum > 0"),
    (["precision.loss_scale=dynamic", "precision.loss_scale_init=0.5"], "precision.loss_scale_init",
     "min_scale (1) <= loss_scale_init"),
    (["distributed.num_processes=2", "distributed.process_id=2"], "distributed.process_id", "< num_processes"),
    (["distributed.coordinator_address=localhost"], "distributed.coordinator_address", "host:port"),
])
def test_cross_field_checks(overrides, path, fragment):
    err = error_of(config_from_dict, MINIMAL, overrides)
    assert err.path == path and fragment in str(err), str(err)


def test_missing_and_unreadable_files(tmp_path):
    err = error_of(load_config, str(tmp_path / "nope.yaml"))
    assert "cannot read config file" in str(err) and "nope.yaml" in str(err)
    write(tmp_path, "run.yaml", "base: missing_base.yaml\n")
    err = error_of(load_config, str(tmp_path / "run.yaml"))
    assert "missing_base.yaml" in str(err) and "included from" in str(err)
    err = error_of(load_config, str(tmp_path))  # a directory is not a readable file
    assert "cannot read config file" in str(err)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "bad.yaml", "model:\n  name: m\noptim: {lr: 0.1\ntrain: {steps: 1}\n")
    err = error_of(load_config, path)
    assert str(err).startswith(f"{path}:") and "YAML syntax error" in str(err)
    path = write(tmp_path, "list.yaml", "- 1\n- 2\n")
    assert "top level must be a mapping" in str(error_of(load_config, path))


def test_base_cycle_detected(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\nmodel: {name: m}\n")
    write(tmp_path, "b.yaml", "base: sub/../a.yaml\n")
    err = error_of(load_config, str(tmp_path / "a.yaml"))
    assert "base include cycle" in str(err) and "a.yaml -> " in str(err)
    write(tmp_path, "self.yaml", "base: self.yaml\n")
    assert "cycle" in str(error_of(load_config, str(tmp_path / "self.yaml")))
    # A diamond (two bases sharing a third) is not a cycle.
    write(tmp_path, "d0.yaml", "optim: {lr: 0.3}\n")
    write(tmp_path, "d1.yaml", "base: d0.yaml\n")
    write(tmp_path, "d2.yaml", "base: d0.yaml\n")
    write(tmp_path, "top.yaml", "base: [d1.yaml, d2.yaml]\nmodel: {name: m}\ntrain: {steps: 1}\n")
    assert load_config(str(tmp_path / "top.yaml")).optim.lr == 0.3


@pytest.mark.parametrize("override, fragment", [
    ("a.b", "no '=' found"),
    ("=3", "is not a dotted key"),
    ("optim..lr=3", "is not a dotted key"),
    ("optim.lr[0]=3", "is not a dotted key"),
    ("base=other.yaml", "'base' can only be set inside a config file"),
    ("optim.lr=[1, 2", "cannot parse value"),
])
def test_bad_override_syntax(override, fragment):
    assert fragment in str(error_of(parse_overrides, [override]))
    assert fragment in str(error_of(config_from_dict, MINIMAL, [override]))


def test_override_errors():
    err = error_of(config_from_dict, MINIMAL, ["optim.lrate=0.1"])
    assert "unknown key 'optim.lrate'" in str(err) and "override 'optim.lrate=0.1'" in str(err)
    err = error_of(config_from_dict, MINIMAL, ["train.steps.value=3"])
    assert "cannot set a key inside train.steps" in str(err)
    assert "list of strings" in str(error_of(parse_overrides, "train.steps=3"))


# -------------------------------------------------------------- durations

@pytest.mark.parametrize("value, steps_per_epoch, expected", [
    (0, None, 0), (250, None, 250), ("250st", None, 250), ("250 steps", None, 250), ("1 step", 7, 1),
    ("3ep", 100, 300), ("3 epochs", 100, 300), ("1epoch", 62, 62), ("0.5ep", 63, 32), ("0.001ep", 62, 1),
    ("0ep", 62, 0), (None, 10, None),
])
def test_resolve_duration(value, steps_per_epoch, expected):
    assert resolve_duration(value, steps_per_epoch) == expected


@pytest.mark.parametrize("value, steps_per_epoch, fragment", [
    ("3ep", None, "steps_per_epoch=None"), ("3ep", 0, "steps_per_epoch=0"), ("2h", 10, "expected a duration"),
    (True, 10, "expected a duration"), (-3, 10, "negative"), (1.5, 10, "expected a duration"),
])
def test_resolve_duration_errors(value, steps_per_epoch, fragment):
    assert fragment in str(error_of(resolve_duration, value, steps_per_epoch))
