"""Tests of jaxcnn.train.config: loading, includes, overrides, validation, durations."""
import glob
import os
import pickle
import textwrap

import pytest
import yaml

from jaxcnn.train.config import (
    SCHEMA, Config, ConfigError, config_from_dict, load_config, parse_overrides,
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
    assert cfg.data.augment.hflip == 0.5 and cfg.data.augment.crop_padding == 4  # deep merge (flip: hflip's old name)
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


@pytest.mark.parametrize("section, key, meant", [
    ("optim", "learning_rate", "optim.lr"), ("optim", "wd", "optim.weight_decay"),
    ("train", "num_epochs", "train.epochs"), ("model", "pretrained", "model.init_from"),
    ("train", "learning_rate", "optim.lr")])  # another library's name, in any section
def test_other_libraries_names_are_answered_with_ours(section, key, meant):
    raw = {**MINIMAL, section: {**MINIMAL.get(section, {}), key: 1}}
    err = error_of(config_from_dict, raw)
    assert f"unknown key '{section}.{key}'; did you mean '{meant}'?" in str(err)


@pytest.mark.parametrize("key, value, hint", [
    ("model.init_from_skip", "fc", "write it in brackets, e.g. model.init_from_skip=[fc]"),
    ("data.image_size", 32, "write it in brackets, e.g. [224, 224] (folder, records) or "
                            "[32, 32, 3] (synthetic)")])
def test_a_list_key_given_one_value_shows_the_list(key, value, hint):
    section, name = key.split(".")
    err = error_of(config_from_dict, {**MINIMAL, section: {**MINIMAL.get(section, {}), name: value}})
    assert f"{key}: expected a list of any number of" in str(err) and f"; {hint} [from" in str(err)


def test_unknown_section():
    err = error_of(config_from_dict, {**MINIMAL, "optimizer": {"lr": 0.1}})
    assert "unknown section 'optimizer'" in str(err) and "did you mean 'optim'?" in str(err)


@pytest.mark.parametrize("override, path, fragment", [
    ("optim.lr=fast", "optim.lr", "expected a float > 0, got 'fast'"),
    ("data.batch_size=12.5", "data.batch_size", "expected an int >= 1 and <= 2147483647, got 12.5"),
    ("data.augment.flip=1", "data.augment.flip", "expected a bool (true/false), got 1"),
    ("model.options=[1]", "model.options", "expected a mapping"),
    ("data.image_size=[32, 32]", "data.image_size", "expected a list of 3 items"),
    ("data.image_size=[32, x, 3]", "data.image_size[1]", "expected an int >= 1 and <= 2147483647, got 'x'"),
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
    ("data.batch_size=0", "expected an int >= 1 and <= 2147483647, got 0"),
    ("mesh.data=0", "expected an int >= 1 and <= 2147483647 or -1, got 0"),
    ("mesh.data=-2", "expected an int >= 1 and <= 2147483647 or -1, got -2"),
    ("checkpoint.keep=0", "expected an int >= 1"),
    ("optim.schedule.warmup=-5", "expected a duration (int steps, '<N>st' or '<N>ep') >= 0 and <= 2147483647, got -5"),
    ("checkpoint.every=0ep", "> 0 and <= 2147483647, got '0ep'"),
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


# ------------------------------------------------ YAML 1.1 words, ranges, durations, duplicates, files

@pytest.mark.parametrize("where", ["file", "override"])
def test_yes_no_on_off_are_words_for_string_keys(tmp_path, where):
    """YAML 1.1 reads unquoted yes/no/on/off as booleans: `checkpoint.resume: yes` was refused as
    'got True', and `distributed.mode: yes` passed as 'on'. A string key sees the word typed."""
    def load(key, value):
        if where == "override":
            return load_config(write(tmp_path, "m.yaml", "model: {name: mnist_cnn}\ntrain: {steps: 1}\n"),
                               [f"{key}={value}"])
        section, name = key.split(".")
        model = "" if section == "model" else "model: {name: mnist_cnn}\n"
        return load_config(write(tmp_path, "w.yaml", f"{model}train: {{steps: 1}}\n"
                                                      f"{section}:\n  {name}: {value}\n"
                                                      + "  name: mnist_cnn\n" * (section == "model")), [])

    err = error_of(load, "checkpoint.resume", "yes")
    assert str(err).startswith("checkpoint.resume: expected one of 'auto', 'must', 'never', got 'yes'"), err
    assert "True" not in str(err)
    assert load("distributed.mode", "on").distributed.mode == "on"
    assert load("distributed.mode", "Off").distributed.mode == "off"
    assert "got 'yes'" in str(error_of(load, "distributed.mode", "yes"))      # not a word mode takes
    assert "got true (a boolean)" in str(error_of(load, "distributed.mode", "true"))
    assert load("data.augment", "{flip: yes}").data.augment.hflip == 0.5     # bool keys: YAML 1.1
    assert load("data.normalize", "off").data.normalize is False
    assert load("model.options", "{cifar_stem: on}").model.options.cifar_stem is True  # free-form data too
    assert "got 'no'" in str(error_of(load, "data.seed", "no"))
    cfg = load("checkpoint.resume", "never")
    assert yaml.safe_load(yaml.safe_dump(to_dict(cfg))) == to_dict(cfg)       # no str subclass leaks out


def int_leaves():
    for path, spec in schema_leaves():
        if spec.type == "int" or (spec.item is not None and spec.item.type == "int"):
            yield path, spec


@pytest.mark.parametrize("path", [p for p, _ in int_leaves()] + ["optim.schedule.warmup", "logging.log_every"])
def test_every_int_key_has_a_range_the_run_can_hold(path):
    """2**31 steps overflowed the int32 step counter, a seed of 2**64 jax.random.PRNGKey: OverflowError
    tracebacks. Every int key (and step duration) now has an upper bound, named in its error."""
    seed = path.endswith("seed")
    top = 2**32 - 1 if seed else 2**31 - 1
    listed = path in ("data.image_size", "parallel.pipeline.split")  # lists of ints
    value = f"[8, 8, {top + 1}]" if listed else str(top + 1)
    shown = f"{path}[2]" if listed else path
    for bad in (value, value.replace(str(top + 1), str(2**64)), value.replace(str(top + 1), "1" + "0" * 400)):
        err = error_of(config_from_dict, MINIMAL, [f"{path}={bad}"])
        assert str(err).startswith(f"{shown}: expected ") and f"<= {top}" in str(err), err
    if path not in ("distributed.process_id", "data.num_classes", "model.num_classes"):  # cross-checked
        ok = value.replace(str(top + 1), str(top))
        config_from_dict(MINIMAL, ["train.steps=null", "train.epochs=1"] * (path == "train.steps")
                         + [f"{path}={ok}"])


def test_float_keys_refuse_ints_beyond_float_range():
    err = error_of(config_from_dict, MINIMAL, ["optim.lr=1" + "0" * 400])
    assert str(err).startswith("optim.lr: expected a float > 0")


@pytest.mark.parametrize("epochs, steps", [(1000000, 62_000_000), ("1e6", 62_000_000), (1234567, 1234567 * 62),
                                           ("0.00001", 1), ("1e-5", 1), (99999, 99999 * 62), (0.5, 31)])
def test_epochs_in_any_spelling(epochs, steps):
    """1e6 epochs became the duration '1e+06ep', which the duration parser refused without naming a
    key (and :g formatting rounded 1234567 to 1234570)."""
    cfg = config_from_dict(MINIMAL, ["train.steps=null", f"train.epochs={epochs}"])
    assert train_steps(cfg.train, 62) == steps
    assert load_round_trip(cfg) == cfg


def load_round_trip(cfg):
    return config_from_dict(yaml.safe_load(yaml.safe_dump(to_dict(cfg))))


def test_epochs_beyond_the_step_counter_name_the_key():
    err = error_of(config_from_dict, MINIMAL, ["train.steps=null", "train.epochs=1e12"])
    assert str(err).startswith("train.epochs: expected a float > 0 and <= 2147483647"), err
    cfg = config_from_dict(MINIMAL, ["train.steps=null", "train.epochs=1e8"])
    err = error_of(train_steps, cfg.train, 62)
    assert str(err).startswith("train.epochs: 1e+08 epochs of 62 steps (6200000000 steps) is more than the "
                               "2147483647 steps"), err


@pytest.mark.parametrize("text, canonical", [("1e+06ep", "1000000ep"), ("1e6 epochs", "1000000ep"),
                                             ("2.5e-1ep", "0.25ep"), ("1e3st", 1000), ("1234567ep", "1234567ep")])
def test_durations_with_exponents(text, canonical):
    cfg = config_from_dict(MINIMAL, [f"checkpoint.every={text}"])
    assert cfg.checkpoint.every == canonical


@pytest.mark.parametrize("value, fragment", [
    ("1e400ep", "finite"), ("100000000ep", "more than the 2147483647 steps"), ("3 days", "expected a duration"),
    (-1, "cannot be negative")])
def test_duration_errors_name_their_key(value, fragment):
    err = error_of(resolve_duration, value, 62, key="checkpoint.every")
    assert str(err).startswith("checkpoint.every: ") and fragment in str(err), err


def test_schedule_durations_in_epochs_name_their_key():
    from jaxcnn.train.optim import build_optimizer
    cfg = config_from_dict(MINIMAL, ["optim.schedule.name=step", "optim.schedule.decay_every=100000000ep"])
    err = error_of(build_optimizer, cfg.optim, total_steps=10, steps_per_epoch=62)
    assert str(err).startswith("optim.schedule.decay_every: "), err


@pytest.mark.parametrize("text, key, lines", [
    ("model:\n  name: mnist_cnn\n  name: resnet18\ntrain: {steps: 1}\n", "model.name", (2, 3)),
    ("model: {name: mnist_cnn}\ntrain: {steps: 1}\ntrain: {epochs: 2}\n", "train", (2, 3)),
    ("model: {name: mnist_cnn, 'name': x}\ntrain: {steps: 1}\n", "model.name", (1, 1)),
    ("model: {name: mnist_cnn}\ntrain: {steps: 1}\noptim:\n  schedule:\n    milestones: [1]\n"
     "    name: multistep\n    milestones: [2]\n", "optim.schedule.milestones", (5, 7)),
])
def test_duplicate_keys_are_refused(tmp_path, text, key, lines):
    """PyYAML keeps the last of two equal keys silently; a config naming a key twice is a mistake."""
    path = write(tmp_path, "dup.yaml", text)
    err = str(error_of(load_config, path))
    assert err.startswith(f"{path}:{lines[1]}: duplicate key {key!r} (also on line {lines[0]})"), err


def test_duplicate_keys_in_overrides_and_merge_keys():
    err = str(error_of(config_from_dict, MINIMAL, ["model.options={a: 1, a: 2}"]))
    assert "duplicate key 'a'" in err and "model.options" in err
    # A YAML merge key (<<) is no duplicate: the mapping's own keys override the merged ones.
    cfg = config_from_dict(MINIMAL, ["optim={<<: {lr: 0.5, b1: 0.8}, lr: 0.25}"])
    assert (cfg.optim.lr, cfg.optim.b1) == (0.25, 0.8)


def test_a_fifo_or_device_is_not_read_as_a_config(tmp_path):
    """Opening a FIFO for reading waited for a writer forever; /dev/zero read a megabyte of NULs."""
    import signal
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)

    def expire(signum, frame):
        raise TimeoutError("load_config hung on a FIFO")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        err = str(error_of(load_config, str(fifo)))
        assert err == f"cannot read config file {str(fifo)!r}: it is a FIFO (named pipe), not a regular file"
        err = str(error_of(load_config, write(tmp_path, "b.yaml", f"base: {fifo}\n")))
        assert "FIFO" in err and "included from" in err
        if os.path.exists("/dev/zero"):
            assert "it is a device" in str(error_of(load_config, "/dev/zero"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_regular_config_via_a_symlink_still_loads(tmp_path):
    path = write(tmp_path, "real.yaml", "model: {name: mnist_cnn}\ntrain: {steps: 3}\n")
    os.symlink(path, tmp_path / "link.yaml")
    assert load_config(str(tmp_path / "link.yaml")).train.steps == 3


# ------------------------------------------------------------ what the user sees

def test_print_config_marks_keys_the_config_does_not_use(capsys):
    """--print-config showed data.num_train: 1024 for MNIST as if it applied; it is marked now, and
    the output is still YAML that loads back to the same config."""
    from jaxcnn.train.cli import train_main
    config = os.path.join(REPO, "configs", "mnist_cnn.yaml")
    assert train_main([config, "--print-config"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "  num_train: 1024  # not used by data.source=mnist" in lines
    assert "  num_eval: 256  # not used by data.source=mnist" in lines
    assert "  momentum: 0.9  # not used by optim.name=adamw" in lines
    assert "    milestones: []  # not used by optim.schedule.name=onecycle" in lines
    assert "    pct_start: 0.3" in lines and "  path: null" in lines and "  b1: 0.9" in lines
    assert config_from_dict(yaml.safe_load(out)) == load_config(config)
    assert train_main([config, "data.source=synthetic", "optim.name=sgd", "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  num_train: 1024" in lines and "  path: null  # not used by data.source=synthetic" in lines
    assert "  momentum: 0.9" in lines and "  b1: 0.9  # not used by optim.name=sgd" in lines


def test_a_key_is_its_field_and_validation_resume_detection_and_print_config_follow_it(
        tmp_path, monkeypatch, capsys):
    """Adding a config key is writing its Field (and the line that reads it): validation, the
    rules across keys, resume-change detection, --print-config's notes and the 'not applied'
    warning all follow from the Field, with no other list to extend."""
    from jaxcnn.errors import ConfigChangedError
    from jaxcnn.train import config as C
    from jaxcnn.train.resume import check_resume_config
    from jaxcnn.train.cli import train_main

    def even(value, cfg):
        return None if value % 2 == 0 else f"expected an even number of widgets, got {value}"

    monkeypatch.setitem(SCHEMA["optim"], "widgets", C.Field(
        "int", 2, "a new training key", low=0, used_when=("optim.name", ("sgd",)), rules=(even,)))
    monkeypatch.setitem(SCHEMA["logging"], "colour", C.Field("bool", False, "a new display key",
                                                             trains=False))
    cfg = config_from_dict(MINIMAL, ["optim.widgets=4"])
    assert cfg.optim.widgets == 4 and cfg.logging.colour is False
    assert error_of(config_from_dict, MINIMAL, ["optim.widgets=3"]).path == "optim.widgets"
    assert "optim.widgets: expected an even number of widgets, got 3" in str(
        error_of(config_from_dict, MINIMAL, ["optim.widgets=3"]))
    assert "did you mean 'optim.widgets'" in str(error_of(config_from_dict, MINIMAL, ["optim.widget=2"]))

    # Resume: a run directory saved under widgets=2 (and an older one without the key at all).
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "1").mkdir(parents=True)
    saved = to_dict(config_from_dict(MINIMAL))
    (workdir / "config.resolved.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigChangedError, match=r"optim\.widgets: 2 -> 4"):
        check_resume_config(str(workdir), to_dict(cfg))
    recoloured = to_dict(config_from_dict(MINIMAL, ["logging.colour=true"]))
    assert check_resume_config(str(workdir), recoloured) == []
    del saved["optim"]["widgets"]
    assert C.config_changes(saved, to_dict(config_from_dict(MINIMAL))) == []
    assert C.config_changes(saved, to_dict(cfg)) == ["optim.widgets: '(unset)' -> 4"]

    # --print-config and the start-up warning: not used by adamw, used by sgd.
    config = write(tmp_path, "c.yaml", "model: {name: mnist_cnn}\ntrain: {steps: 10}\n")
    assert train_main([config, "optim.widgets=4", "--print-config"]) == 0
    assert "  widgets: 4  # not used by optim.name=adamw" in capsys.readouterr().out.splitlines()
    assert C.set_but_unused(cfg) == ["optim.widgets=4 (not used by optim.name=adamw)"]
    sgd = config_from_dict(MINIMAL, ["optim.name=sgd", "optim.widgets=4"])
    assert C.set_but_unused(sgd) == [] and "  widgets: 4\n" in C.dump_config(sgd)


def test_keys_an_older_or_newer_version_saved_count_by_their_section():
    """A key the schema does not know changes training unless its section holds only keys that
    do not (a removed logging or mesh setting in a saved config is no change on resume)."""
    from jaxcnn.train.config import config_changes
    old = {"optim": {"lr": 0.1}, "logging": {"colour": True}, "mesh": {"rows": 2},
           "parallel": {"spatial": {"ring": 1}}}
    assert config_changes(old, {"optim": {"lr": 0.1}}) == []
    assert config_changes({"optim": {"lr": 0.1, "gone": 1}}, {"optim": {"lr": 0.1}}) == [
        "optim.gone: 1 -> '(unset)'"]
    assert config_changes({"parallel": {"gone": 1}}, {}) == ["parallel.gone: 1 -> '(unset)'"]


def test_a_rule_of_a_key_the_source_does_not_use_does_not_apply():
    """data.eval_resize is read by image folders and records only: a synthetic run that sets it
    is told it is not applied, never refused for it."""
    from jaxcnn.train.config import set_but_unused
    args = ["data.source=synthetic", "data.image_size=[64, 64, 3]", "data.eval_resize=32"]
    cfg = config_from_dict(MINIMAL, args)
    assert set_but_unused(cfg) == ["data.eval_resize=32 (not used by data.source=synthetic)"]
    folder = ["data.source=folder", "data.path=x", "data.image_size=[64, 64]", "data.eval_resize=32"]
    assert error_of(config_from_dict, MINIMAL, folder).path == "data.eval_resize"


TINY = ["model.name=mnist_cnn", "data.source=synthetic", "data.image_size=[12, 12, 1]", "data.num_train=16",
        "data.num_eval=8", "data.batch_size=8", "data.prefetch=0", "train.epochs=null", "train.steps=1",
        "train.eval_every=null"]


@pytest.mark.parametrize("policy, extra, text", [
    ("fp32", [], "precision fp32  loss scaling off"),
    ("bf16", [], "precision bf16 (params f32, compute bf16)  loss scaling off"),
    ("bf16_params", [], "precision bf16_params (params bf16, compute bf16, output f32, master copy f32)  "
                        "loss scaling off"),
    ("fp16", [], "precision fp16 (params f32, compute f16)  loss scaling dynamic (from 32768)"),
    ("fp32", ["precision.loss_scale=static", "precision.loss_scale_init=128"],
     "precision fp32  loss scaling static (128)"),
    ("bf16", ["precision.overrides={batch_norm: f32}"],
     "precision bf16 (params f32, compute bf16) with batch_norm f32  loss scaling off"),
])
def test_startup_output_describes_precision_in_the_configs_words(policy, extra, text):
    """The start-up line said 'policy p=f32,c=f32,o=f32  loss scale NoOpLossScale'."""
    from jaxcnn.train.metrics import describe_precision
    from jaxcnn.train._build import build_run
    cfg = load_config(os.path.join(REPO, "configs", "mnist_cnn.yaml"), TINY + [f"precision.policy={policy}"] + extra)
    assert describe_precision(cfg, build_run(cfg)) == text


def test_startup_output_mentions_fsdp_and_the_model_axis_only_when_used():
    from types import SimpleNamespace

    import jax

    from jaxcnn.train.metrics import describe_devices
    def plan(data, model, fsdp):
        return SimpleNamespace(mesh=SimpleNamespace(shape={"data": data, "model": model}),
                               strategy="shard_map", fsdp=fsdp)
    n, backend = jax.device_count(), jax.default_backend()
    assert describe_devices(plan(n, 1, False)) == f"devices {n} ({backend}): data parallel over {n} (shard_map)"
    text = describe_devices(plan(2, 2, True))
    assert ", model parallel over 2" in text and "(fsdp)" in text and "False" not in text
    split = SimpleNamespace(mesh=SimpleNamespace(shape={"data": 2, "model": 1}), strategy="jit", fsdp=False,
                            spatial=SimpleNamespace(shards=4, gather_after="layer2.3"), spatial_remat=True)
    # a spatial run's start-up line said only "data parallel over 2 (jit)"
    assert describe_devices(split).endswith(
        "data parallel over 2 (jit), images split along height over 4 (through layer2.3, remat)")
    explicit = SimpleNamespace(**{**vars(split), "spatial_remat": False, "spatial_halo": "explicit"})
    assert describe_devices(explicit).endswith("over 4 (through layer2.3, explicit halos)")


def test_startup_output_on_one_device_says_so(monkeypatch):
    """It said "data parallel over 1 (shard_map)"."""
    from types import SimpleNamespace

    import jax

    from jaxcnn.train.metrics import describe_devices
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    one = SimpleNamespace(mesh=SimpleNamespace(shape={"data": 1, "model": 1}), strategy="shard_map",
                          fsdp=False)
    assert describe_devices(one) == f"devices 1 ({jax.default_backend()}): one device"



def test_a_leading_tilde_in_a_path_key_is_the_home_directory(tmp_path, monkeypatch):
    """``path: ~/data/x.npz`` in a config file (where no shell expands it) was "does not exist"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: {name: mnist_cnn, init_from: ~/p.npz}\ntrain: {steps: 1}\n"
                        "data: {source: npz, path: ~/d.npz}\nlogging: {workdir: ~/runs/x}\n")
    cfg = load_config(cfg_file)
    assert (cfg.data.path, cfg.model.init_from, cfg.logging.workdir) == (
        str(tmp_path / "d.npz"), str(tmp_path / "p.npz"), str(tmp_path / "runs" / "x"))
    cfg = load_config(cfg_file, ["data.path=d~.npz", "model.init_from=null"])
    assert cfg.data.path == "d~.npz" and cfg.model.init_from is None


def test_val_split_is_a_share_of_an_image_folder_or_records():
    folder = {**MINIMAL, "data": {"source": "folder", "path": "p", "val_split": 0.1}}
    assert config_from_dict(folder).data.val_split == 0.1
    assert config_from_dict(MINIMAL).data.val_split is None
    for bad in (0, 1, 1.5, -0.1):
        err = error_of(config_from_dict, {**MINIMAL, "data": {**folder["data"], "val_split": bad}})
        assert str(err).startswith(f"data.val_split: expected a float > 0 and < 1 or null, got {float(bad)!r}"), err
    for source in ("mnist", "cifar10", "npz", "synthetic"):
        err = error_of(config_from_dict, {**MINIMAL, "data": {"source": source, "path": "p", "val_split": 0.2}})
        assert str(err).startswith(f"data.val_split: 0.2 splits an image folder or records (data.source: folder "
                                   f"or records); data.source={source!r} has its own test split: set "
                                   "data.val_split: null"), err
    err = error_of(config_from_dict, {**MINIMAL, "data": {"source": "folder", "path": "p", "validation_split": 0.2}})
    assert "data.val_split" in str(err)


# ------------------------------------------------------------------ data.augment

def test_augment_none_is_no_aug_and_loads_back(tmp_path):
    path = write(tmp_path, "c.yaml", """\
        base: b.yaml
        data: {augment: none}
        """)
    write(tmp_path, "b.yaml", """\
        model: {name: mnist_cnn}
        train: {steps: 10}
        data: {augment: {crop_padding: 4, flip: true, mixup: {alpha: 0.2}}}
        """)
    cfg = load_config(path)  # none replaces the base's whole section, mixup included
    augment = cfg.data.augment
    assert augment.no_aug is True and augment.crop_padding == 0 and augment.hflip is None
    assert augment.mixup.alpha == 0.0
    assert config_from_dict(to_dict(cfg)) == cfg == config_from_dict(MINIMAL, ["data.augment=none"])
    assert load_config(path, ["data.augment.no_aug=false", "data.augment.scale=[0.8, 1]"]).data.augment.no_aug is False
    bicubic = load_config(path, ["data.source=folder", "data.path=x",
                                 "data.augment.interpolation=bicubic"]).data.augment  # none, then a key
    assert bicubic.no_aug is True and bicubic.interpolation == "bicubic"
    err = error_of(load_config, path, ["data.augment=None", "data.augment.hflip=0.5"])
    assert str(err).startswith("data.augment.no_aug: true (no augmentation at all) but data.augment.hflip=0.5")


def test_old_flip_key_reads_as_hflip_in_configs_and_resume_comparisons():
    from jaxcnn.train.config import config_changes, config_digest
    on = config_from_dict(MINIMAL, ["data.augment.flip=true", "data.augment.crop_padding=2"])
    assert on.data.augment.hflip == 0.5 and "flip" not in on.data.augment
    assert config_from_dict(MINIMAL, ["data.augment.flip=false"]) == config_from_dict(MINIMAL)
    # A config recorded before hflip (flip: true, no new keys) compares equal to today's reading of it.
    recorded = to_dict(on)
    recorded["data"]["augment"] = {"crop_padding": 2, "flip": True, "mixup": {"alpha": 0.0, "prob": 1.0},
                                   "cutmix": {"alpha": 0.0, "prob": 1.0}}
    assert config_changes(recorded, to_dict(on)) == []
    unflipped = to_dict(config_from_dict(MINIMAL, ["data.augment.crop_padding=2"]))
    off = dict(recorded, data=dict(recorded["data"], augment=dict(recorded["data"]["augment"], flip=False)))
    assert config_changes(off, unflipped) == []
    assert config_changes(recorded, unflipped) == ["data.augment.hflip: 0.5 -> None"]
    assert config_digest(to_dict(on)) != config_digest(recorded)  # the checkpoints fall back to config_changes


@pytest.mark.parametrize("overrides, path, fragment", [
    (["data.augment=off"], "data.augment", "expected a mapping of keys or 'none' (no augmentation at all)"),
    (["data.augment=sometimes"], "data.augment", "expected a mapping of keys or 'none'"),
    (["data.augment.flip=1"], "data.augment.flip", "expected a bool (true/false), got 1 (flip is the old name"),
    (["data.augment={flip: true, hflip: 0.2}"], "data.augment.flip", "keep hflip"),
    (["data.augment.no_aug=true", "data.augment.crop_padding=2"], "data.augment.no_aug",
     "true (no augmentation at all) but data.augment.crop_padding=2 is set: drop one"),
    (["data.augment.no_aug=true", "data.augment.cutmix.alpha=1"], "data.augment.no_aug",
     "but data.augment.cutmix.alpha=1.0 is set"),
    (["data.augment.scale=[0.9, 0.5]"], "data.augment.scale", "expected [lo, hi] with lo <= hi, got [0.9, 0.5]"),
    (["data.augment.scale=[0, 1]"], "data.augment.scale[0]", "expected a float > 0 and <= 1, got 0"),
    (["data.augment.scale=0.5"], "data.augment.scale", "e.g. [0.8, 1.0]"),
    (["data.augment.ratio=[1]"], "data.augment.ratio", "expected a list of 2 items"),
    (["data.augment.hflip=1.5"], "data.augment.hflip", "expected a float >= 0 and <= 1 or null, got 1.5"),
    (["data.augment.vflip=-0.1"], "data.augment.vflip", "expected a float >= 0 and <= 1, got -0.1"),
    (["data.augment.interpolation=lanczos"], "data.augment.interpolation", "'bilinear', 'bicubic', 'nearest'"),
    (["data.augment.interpolation=bicubic"], "data.augment.interpolation",
     "data.source='mnist' has none: its images are used at their size; set data.augment.scale"),
    (["data.source=folder", "data.path=x", "data.augment.crop_pct=0.9", "data.eval_resize=256"],
     "data.augment.crop_pct", "0.9 and data.eval_resize=256 both set the evaluation resize"),
    (["data.augment.crop_pct=0.1"], "data.augment.crop_pct", "expected a float >= 0.125 and <= 1 or null"),
])
def test_augment_errors_are_one_line_naming_the_key(overrides, path, fragment):
    err = error_of(config_from_dict, MINIMAL, overrides)
    assert err.path == path and str(err).startswith(path + ":") and fragment in str(err), str(err)


def test_augment_keys_accepted_for_every_source():
    for source in ("mnist", "folder"):
        cfg = config_from_dict(MINIMAL, [f"data.source={source}", "data.path=x", "data.augment.scale=[0.8, 1]",
                                         "data.augment.ratio=[1, 1]", "data.augment.hflip=0",
                                         "data.augment.vflip=0.5", "data.augment.interpolation=bicubic",
                                         "data.augment.crop_padding=2"])
        assert cfg.data.augment.scale == (0.8, 1.0) and cfg.data.augment.interpolation == "bicubic"
    from jaxcnn.data.transforms import INTERPOLATIONS
    from jaxcnn.train.config import INTERPOLATIONS as SCHEMA_INTERPOLATIONS
    assert SCHEMA_INTERPOLATIONS == INTERPOLATIONS


def test_a_layer_with_the_old_flip_key_is_overridden_as_flip_was(tmp_path):
    """Each file and override reads flip as hflip before it is merged: a later layer's hflip
    overrides a base's flip: true, and a later flip: false a base's hflip."""
    write(tmp_path, "b.yaml", """\
        model: {name: mnist_cnn}
        train: {steps: 10}
        data: {augment: {crop_padding: 4, flip: true}}
        """)
    path = write(tmp_path, "c.yaml", "base: b.yaml\ndata: {augment: {hflip: 0.2}}\n")
    assert load_config(path).data.augment.hflip == 0.2
    assert load_config(path, ["data.augment.flip=false"]).data.augment.hflip is None
    assert load_config(path, ["data.augment={flip: true}"]).data.augment.hflip == 0.5
    assert load_config(write(tmp_path, "d.yaml", "base: b.yaml\n"), ["data.augment.hflip=0"]).data.augment.hflip == 0
    err = error_of(load_config, write(tmp_path, "e.yaml", "base: b.yaml\ndata: {augment: {flip: true, hflip: 1}}\n"))
    assert err.path == "data.augment.flip" and "keep hflip" in str(err) and "e.yaml" in str(err)
    recorded = to_dict(load_config(path))
    recorded["data"]["augment"]["flip"] = True
    del recorded["data"]["augment"]["hflip"]
    assert config_from_dict(recorded, ["data.augment.hflip=0"]).data.augment.hflip == 0


@pytest.mark.parametrize("overrides, path, fragment", [
    (["data.augment.color_jitter=[0.4, 0.4, 0.4]"], "data.augment.color_jitter",
     "works on decoded image files (data.source: folder or records); data.source='mnist' is in-memory arrays"),
    (["data.augment.reprob=0.25"], "data.augment.reprob", "data.source='mnist' is in-memory arrays"),
    (["data.source=folder", "data.path=x", "data.augment.color_jitter=strong"], "data.augment.color_jitter",
     "0.4 (= [0.4, 0.4, 0.4]) or [0.4, 0.4, 0.4, 0.1]"),
    (["data.source=folder", "data.path=x", "data.augment.color_jitter=[0.4, 0.4]"], "data.augment.color_jitter",
     "expected [brightness, contrast, saturation] or [..., hue]"),
    (["data.source=folder", "data.path=x", "data.augment.auto_augment=rand-q9"], "data.augment.auto_augment",
     "expected e.g. 'rand-m9-n2-mstd0.5-inc1'"),
    (["data.source=folder", "data.path=x", "data.augment.auto_augment=rand-m9",
      "data.augment.color_jitter=[0.4, 0.4, 0.4]"], "data.augment.auto_augment",
     "timm turns colour jitter off under auto_augment (unless its string has '3a'); set one of them"),
    (["data.augment=none", "data.source=folder", "data.path=x", "data.augment.reprob=0.5"], "data.augment.no_aug",
     "but data.augment.reprob=0.5 is set"),
])
def test_photometric_augment_errors_are_one_line_naming_the_key(overrides, path, fragment):
    err = error_of(config_from_dict, MINIMAL, overrides)
    assert err.path == path and str(err).startswith(path + ":") and fragment in str(err), str(err)
    assert "\n" not in str(err)


def test_photometric_augment_keys_reach_the_image_files_augment():
    from jaxcnn.train._data import augment_spec
    cfg = config_from_dict(MINIMAL, ["data.source=folder", "data.path=x", "data.augment.color_jitter=[0.4, 0.3, 0.2]",
                                     "data.augment.auto_augment=rand-m9-mstd0.5-t3a", "data.augment.reprob=0.25",
                                     "data.augment.remode=const"])
    augment = augment_spec(cfg)
    assert augment.color_jitter == (0.4, 0.3, 0.2, 0.0) and augment.auto_augment == "rand-m9-mstd0.5-t3a"
    assert (augment.reprob, augment.remode, augment.hflip) == (0.25, "const", 0.5)


def test_without_augmentation_the_evaluation_resize_is_a_training_key():
    """data.augment: none on an image folder trains on evaluation's resize, so a resume that
    changes crop_pct or eval_resize changes training; with augmentation it changes only the
    evaluation."""
    from jaxcnn.train.config import config_changes
    folder = ["data.source=folder", "data.path=x"]
    for base, key, a, b in ((["data.augment=none"], "data.augment.crop_pct", "0.9", "0.5"),
                            (["data.augment=none"], "data.eval_resize", "40", "48")):
        old, new = (to_dict(config_from_dict(MINIMAL, folder + base + [f"{key}={v}"])) for v in (a, b))
        assert config_changes(old, new) == [f"{key}: {float(a) if 'pct' in key else int(a)!r} -> "
                                            f"{float(b) if 'pct' in key else int(b)!r}"]
        augmented = [to_dict(config_from_dict(MINIMAL, folder + [f"{key}={v}"])) for v in (a, b)]
        assert config_changes(*augmented) == []


def test_a_number_for_color_jitter_is_timms_form_and_none_takes_what_augments_nothing():
    folder = ["data.source=folder", "data.path=x"]
    assert config_from_dict(MINIMAL, folder + ["data.augment.color_jitter=0.4"]).data.augment.color_jitter == \
        (0.4, 0.4, 0.4)
    assert config_from_dict(MINIMAL, folder + ["data.augment=none", "data.augment.hflip=0"]).data.augment.no_aug
    err = error_of(config_from_dict, MINIMAL, folder + ["data.augment=none", "data.augment.remode=const"])
    assert str(err).startswith("data.augment.no_aug: true (no augmentation at all) but data.augment.remode='const'")
