"""Mixed precision: dtype policies, matmul precision and loss scaling.

A :class:`Policy` names the dtypes parameters are stored in
(``param_dtype``), layers compute in (``compute_dtype``) and the whole model
returns (``output_dtype``), plus an optional float32 ``master_dtype`` copy of the
parameters kept by the optimiser.  Layers cast at their boundary:
``apply(..., policy=p)`` casts its input and parameters with
``cast_for(p, kind, ...)`` and returns the compute dtype; only a whole model
(:func:`jaxcnn.layers.whole_model`, which every :func:`jaxcnn.models.get` model
is) casts its output to ``output_dtype``.  Layer kinds that must stay accurate
(:data:`DEFAULT_FP32_KINDS`: normalisation, softmax, losses) compute in
float32 unless the configuration overrides them.

Policies never depend on the platform: ``"bf16"`` means bfloat16 on every
backend, and float16 is only used when asked for.

Loss scales (:class:`NoOpLossScale`, :class:`StaticLossScale`,
:class:`DynamicLossScale`) are immutable pytrees.  The scale and step counter
are array leaves; every hyperparameter is static pytree metadata, so it
survives ``jit``, ``tree_map``, ``lax.scan`` and checkpoint restores with a
target tree.  A train step uses them like this::

    grads = ls.unscale(jax.grad(lambda p: ls.scale(loss_fn(p)))(params))
    finite = all_finite(grads)
    new_ls = ls.adjust(finite)
    params, opt_state = select_tree(finite, (new_params, new_opt_state),
                                    (params, opt_state))

The number of skipped steps is counted by the train state
(``jaxcnn.train.state.TrainState.skipped``), not by the loss scale.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_DTYPE_NAMES = {
    "f32": jnp.float32, "fp32": jnp.float32, "float32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f16": jnp.float16, "fp16": jnp.float16, "float16": jnp.float16,
}
# One canonical object per dtype (the jnp scalar type), so that policies built
# from strings, numpy dtypes or jnp types compare and hash equal.
_CANONICAL = {np.dtype(t): t for t in (jnp.float32, jnp.bfloat16, jnp.float16)}
_SHORT_NAME = {jnp.float32: "f32", jnp.bfloat16: "bf16", jnp.float16: "f16"}

# Layer kinds that compute in float32 unless the user overrides them.
DEFAULT_FP32_KINDS = ("batch_norm", "layer_norm", "group_norm", "softmax", "loss")

_KEYS = {"p": "param_dtype", "param": "param_dtype",
         "c": "compute_dtype", "compute": "compute_dtype",
         "o": "output_dtype", "output": "output_dtype",
         "m": "master_dtype", "master": "master_dtype"}


def parse_dtype(name_or_dtype) -> Any:
    """The canonical jnp scalar type for a float dtype name or dtype.

    Arguments:
        name_or_dtype: ``"f32"|"fp32"|"float32"|"bf16"|"bfloat16"|"f16"|"fp16"|
            "float16"`` (any case), a numpy/jnp dtype or scalar type, or None.

    Returns ``jnp.float32``, ``jnp.bfloat16`` or ``jnp.float16``; None for None
    (handy for optional settings such as optax's ``mu_dtype``).
    """
    if name_or_dtype is None:
        return None
    if isinstance(name_or_dtype, str):
        try:
            return _DTYPE_NAMES[name_or_dtype.strip().lower()]
        except KeyError:
            raise ValueError(
                f"unknown dtype {name_or_dtype!r}; expected one of "
                f"{sorted(set(_DTYPE_NAMES))}") from None
    try:
        return _CANONICAL[np.dtype(name_or_dtype)]
    except (KeyError, TypeError):
        raise ValueError(
            f"unsupported policy dtype {name_or_dtype!r}; expected float32, "
            "bfloat16 or float16") from None


def cast_floating(tree, dtype):
    """Cast the floating-point leaves of ``tree`` to ``dtype``; others untouched."""
    def cast(x):
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree_util.tree_map(cast, tree)


class Policy(NamedTuple):
    """Which dtypes parameters, computation and outputs use.

    Arguments:
        param_dtype: dtype parameters are stored in.
        compute_dtype: dtype layers compute in.
        output_dtype: dtype a whole model's output is cast to: what
            ``apply`` of a :func:`jaxcnn.models.get` model (or any layer wrapped
            in :func:`jaxcnn.layers.whole_model`) returns.  A single layer, a
            pipeline stage or a spatial unit returns ``compute_dtype``; the
            trainer's loss casts the logits to its own dtype (float32 unless
            ``overrides`` say otherwise) either way.
        overrides: ``((kind, Policy), ...)`` per layer kind; kinds listed in
            :data:`DEFAULT_FP32_KINDS` compute in float32 unless overridden.
        master_dtype: dtype of the copy of the parameters the optimiser
            updates when it differs from ``param_dtype`` (``bf16_params``
            keeps a float32 master copy); None when the optimiser updates the
            stored parameters directly.

    Build one with :meth:`Policy.parse` or :func:`get_policy`.
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    overrides: tuple = ()
    master_dtype: Any = None

    @classmethod
    def parse(cls, spec: str) -> "Policy":
        """Parse a preset name or a ``"p=f32,c=bf16,o=f32"`` string.

        Arguments:
            spec: a preset (see :data:`PRESETS`; a bare dtype name such as
                ``"bf16"`` means float32 parameters and outputs with that
                compute dtype), or comma-separated ``key=dtype`` pairs in any
                order with keys ``p|param``, ``c|compute``, ``o|output`` and
                ``m|master``; missing p/c/o default to float32, missing m to
                no master copy.

        Raises ValueError naming the bad part and listing the valid forms.
        """
        return cls(**_parse_fields(spec))

    @property
    def needs_master_copy(self) -> bool:
        """Whether the optimiser must keep a ``master_dtype`` copy of the parameters."""
        return self.master_dtype is not None

    @property
    def default_loss_scale(self) -> str:
        """The loss-scale kind this policy wants by default (``make_loss_scale`` kind).

        ``"dynamic"`` when anything (parameters or any layer's computation) is
        float16, whose narrow exponent range underflows small gradients;
        ``"none"`` otherwise (bfloat16 has float32's range).
        """
        policies = (self,) + tuple(p for _, p in self.overrides)
        dtypes = {d for p in policies for d in (p.param_dtype, p.compute_dtype)}
        return "dynamic" if any(np.dtype(d) == np.float16 for d in dtypes) else "none"

    def for_layer(self, kind: str) -> "Policy":
        """The policy a layer of type ``kind`` should use."""
        for k, p in self.overrides:
            if k == kind:
                return p
        if kind in DEFAULT_FP32_KINDS:
            return Policy(self.param_dtype, jnp.float32, self.output_dtype)
        return self

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> "Policy":
        """This policy with per-layer-kind overrides added (replacing same kinds).

        Arguments:
            overrides: ``{kind: spec}`` as in the config's
                ``precision.overrides``.  ``spec`` is a Policy, a preset or
                dtype name (sets the kind's compute dtype: ``{batch_norm:
                fp32}``), or a ``key=dtype`` string whose missing keys are
                taken from this policy.
        """
        if not overrides:
            return self
        if not isinstance(overrides, Mapping):
            raise ValueError(f"precision overrides must be a mapping kind -> policy, "
                             f"got {type(overrides).__name__}")
        merged = dict(self.overrides)
        for kind, spec in overrides.items():
            if not isinstance(kind, str) or not kind.isidentifier():
                raise ValueError(f"precision override key {kind!r} is not a layer kind "
                                 "(expected a name such as 'batch_norm')")
            merged[kind] = self._override_policy(kind, spec)
        return self._replace(overrides=tuple(merged.items()))

    def _override_policy(self, kind, spec) -> "Policy":
        if isinstance(spec, Policy):
            return spec._replace(overrides=())
        if not isinstance(spec, str):
            raise ValueError(f"precision override for {kind!r} must be a string or "
                             f"Policy, got {spec!r}")
        base = self._replace(overrides=())
        try:
            if "=" in spec:
                return base._replace(**_parse_pairs(spec))
            return base._replace(compute_dtype=Policy.parse(spec).compute_dtype)
        except ValueError as e:
            raise ValueError(f"precision override for {kind!r}: {e}") from None

    def to_string(self) -> str:
        """``"p=..,c=..,o=..[,m=..]"``, which :meth:`parse` turns back into this
        policy (without overrides)."""
        parts = [f"{k}={_SHORT_NAME[parse_dtype(d)]}" for k, d in
                 (("p", self.param_dtype), ("c", self.compute_dtype), ("o", self.output_dtype),
                  ("m", self.master_dtype)) if d is not None]
        return ",".join(parts)

    def cast_to_compute(self, tree):
        """Cast the floating leaves of ``tree`` to ``compute_dtype``; others untouched."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree):
        """Cast the floating leaves of ``tree`` to ``param_dtype``; others untouched."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_output(self, tree):
        """Cast the floating leaves of ``tree`` to ``output_dtype``; others untouched."""
        return cast_floating(tree, self.output_dtype)


PRESETS = {
    "fp32": Policy(jnp.float32, jnp.float32, jnp.float32),
    "bf16": Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "bf16_params": Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32, master_dtype=jnp.float32),
    "fp16": Policy(jnp.float32, jnp.float16, jnp.float32),
}
"""Named policies.  Bare dtype names (``f32``, ``bfloat16``, ``f16``, ...) are
accepted too and mean float32 parameters and outputs with that compute dtype."""

_FORMS = ("valid forms: a preset (" + ", ".join(PRESETS) + ", or a dtype name such as "
          "'bf16'), or comma-separated key=dtype pairs such as 'p=f32,c=bf16,o=f32' "
          "with keys p|param, c|compute, o|output, m|master and dtypes "
          + ", ".join(sorted(set(_DTYPE_NAMES))))


def _parse_pairs(spec: str) -> dict:
    items = []
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"bad policy item {part.strip()!r} in {spec!r}; {_FORMS}")
        items.append((key, value))
    return _fields_from_items(items, spec)


def _fields_from_items(items, spec) -> dict:
    fields = {}
    for key, value in items:
        name = _KEYS.get(str(key).strip().lower())
        if name is None:
            raise ValueError(f"bad policy key {key!r} in {spec!r}; {_FORMS}")
        if name in fields:
            raise ValueError(f"policy {spec!r} sets {name} twice; {_FORMS}")
        try:
            fields[name] = parse_dtype(value)
        except ValueError as e:
            raise ValueError(f"bad policy value for {key!r} in {spec!r}: {e}") from None
    master = fields.get("master_dtype")
    if master is not None and master is fields.get("param_dtype", jnp.float32):
        raise ValueError(f"policy {spec!r}: master dtype equals the param dtype; "
                         "leave m out when no separate master copy is wanted")
    return fields


def _parse_fields(spec) -> dict:
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"bad precision policy {spec!r}; {_FORMS}")
    name = spec.strip().lower()
    if name in PRESETS:
        return PRESETS[name]._asdict()
    if name in _DTYPE_NAMES:
        return {"compute_dtype": _DTYPE_NAMES[name]}
    if "=" not in name:
        raise ValueError(f"unknown precision preset {spec!r}; {_FORMS}")
    return _parse_pairs(spec)


def get_policy(spec, overrides: Mapping[str, Any] | None = None) -> Policy:
    """Build a policy from a config value.

    Arguments:
        spec: a :class:`Policy`, a preset name, a ``"p=..,c=..,o=.."`` string
            (see :meth:`Policy.parse`) or a mapping of the same keys
            (``{"param": "f32", "compute": "bf16"}``).
        overrides: ``{kind: spec}`` per layer kind (the config's
            ``precision.overrides``), see :meth:`Policy.with_overrides`.
    """
    if isinstance(spec, Policy):
        policy = spec
    elif isinstance(spec, Mapping):
        policy = Policy(**_fields_from_items(spec.items(), dict(spec)))
    else:
        policy = Policy.parse(spec)
    return policy.with_overrides(overrides)


@functools.lru_cache(maxsize=64)
def _named_policy(name: str) -> Policy:
    return get_policy(name)


def as_policy(policy) -> Policy | None:
    """The :class:`Policy` a layer's ``apply(..., policy=)`` argument stands for.

    Arguments:
        policy: a :class:`Policy`, None (no casting), or a name the config's
            ``precision.policy`` accepts (``"bf16"``, ``"p=f32,c=bf16,o=f32"``...),
            read by :func:`get_policy` as the trainer reads it.

    Raises ValueError for an unknown name and TypeError for any other type,
    each naming ``policy``, the bad value and the accepted forms.
    """
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        try:
            return _named_policy(policy)
        except ValueError as e:
            raise ValueError(f"policy={policy!r}: {e}") from None
    raise TypeError(f"policy must be a jaxcnn.precision.Policy, a policy name or None, got "
                    f"{type(policy).__name__} {policy!r}; {_FORMS}")


def cast_for(policy: Policy | str | None, kind: str, tree):
    """Cast ``tree`` to the compute dtype ``policy`` gives layer ``kind``;
    identity when ``policy`` is None.  ``policy`` may be a name (see :func:`as_policy`)."""
    policy = as_policy(policy)
    if policy is None:
        return tree
    return policy.for_layer(kind).cast_to_compute(tree)


# --- matmul precision -------------------------------------------------------

_MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


def check_matmul_precision(name: str | None) -> str | None:
    """Validate a ``matmul_precision`` setting; returns it lower-cased.

    Arguments:
        name: ``"default"`` (fastest: bf16 passes on TPU, TF32 on Ampere+),
            ``"high"`` (TF32 / 3-pass bf16), ``"highest"`` (full float32),
            their aliases ``"bfloat16"``, ``"tensorfloat32"``, ``"float32"``,
            or None (leave JAX's setting alone).
    """
    if name is None:
        return None
    if not isinstance(name, str) or name.strip().lower() not in _MATMUL_PRECISIONS:
        raise ValueError(f"unknown matmul_precision {name!r}; expected one of "
                         f"{list(_MATMUL_PRECISIONS)} or None")
    return name.strip().lower()


def matmul_precision_context(name: str | None):
    """Context manager setting ``jax.default_matmul_precision`` (None: no change).

    It must surround the *tracing* of a jitted function (its first call, or
    ``.lower``): the precision is baked into the compiled program, and calls
    under a different setting trace and compile again.

    Arguments:
        name: see :func:`check_matmul_precision`.
    """
    name = check_matmul_precision(name)
    if name is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(name)


# --- loss scaling -----------------------------------------------------------

def _register(cls, data_fields, meta_fields):
    """Register a frozen dataclass as a pytree whose ``meta_fields`` are static.

    Unflattening bypasses ``__init__``, so JAX may rebuild the object with
    tracers or placeholder leaves without tripping the validation there.
    """
    def flatten_with_keys(obj):
        children = tuple((jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in data_fields)
        return children, tuple(getattr(obj, f) for f in meta_fields)

    def unflatten(meta, children):
        obj = object.__new__(cls)
        for f, v in zip(data_fields + meta_fields, tuple(children) + tuple(meta)):
            object.__setattr__(obj, f, v)
        return obj

    jax.tree_util.register_pytree_with_keys(
        cls, flatten_with_keys, unflatten,
        flatten_func=lambda obj: (tuple(getattr(obj, f) for f in data_fields),
                                  tuple(getattr(obj, f) for f in meta_fields)))
    cls._data_fields, cls._meta_fields = data_fields, meta_fields
    return cls


def _mul_floating(tree, factor):
    """Multiply floating leaves by a float32 scalar, computing in at least
    float32 so a power-of-two factor is exact and never overflows in the
    factor itself (2**24 does not fit in float16)."""
    def mul(x):
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        wide = jnp.promote_types(x.dtype, jnp.float32)
        return (x.astype(wide) * factor.astype(wide)).astype(x.dtype)
    return jax.tree_util.tree_map(mul, tree)


def _as_scalar(value, dtype, what):
    arr = jnp.asarray(value, dtype)
    if arr.shape != ():
        raise ValueError(f"{what} must be a scalar, got shape {arr.shape}")
    return arr


def _finite_flag(grads_finite):
    flag = jnp.asarray(grads_finite)
    if flag.shape != () or flag.dtype != jnp.bool_:
        raise ValueError("adjust(grads_finite) expects a boolean scalar such as "
                         f"all_finite(grads), got {flag.dtype} array of shape {flag.shape}")
    return flag


class _LossScaleMixin:
    def to_state_dict(self) -> dict:
        """Host numpy copy of every field plus ``"kind"``, for npz or JSON-ish storage."""
        d = {"kind": np.asarray(_KIND_OF[type(self)])}
        d.update({f: np.asarray(getattr(self, f)) for f in self._data_fields + self._meta_fields})
        return d

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]):
        """Inverse of :meth:`to_state_dict` (the ``"kind"`` entry must match)."""
        kind = str(np.asarray(d.get("kind", _KIND_OF[cls])))
        if kind != _KIND_OF[cls]:
            raise ValueError(f"state dict holds a {kind!r} loss scale, not {_KIND_OF[cls]!r}")
        fields = cls._data_fields + cls._meta_fields
        missing = [f for f in fields if f not in d]
        if missing:
            raise ValueError(f"{cls.__name__} state dict lacks {missing}")
        meta = {f: np.asarray(d[f]).item() for f in cls._meta_fields}
        return cls(**{f: d[f] for f in cls._data_fields}, **meta)


@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(_LossScaleMixin):
    """No loss scaling (float32 or bfloat16 training): every method is the identity."""

    def scale(self, tree):
        """Return ``tree`` unchanged."""
        return tree

    def unscale(self, tree):
        """Return ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite) -> "NoOpLossScale":
        """Return ``self``."""
        _finite_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_LossScaleMixin):
    """A fixed loss scale.

    Arguments:
        loss_scale: float32 scalar the loss is multiplied by; powers of two keep
            scaling and unscaling exact.
    """

    loss_scale: Any

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _as_scalar(self.loss_scale, jnp.float32, "loss_scale"))

    def scale(self, tree):
        """Multiply the floating leaves of ``tree`` (the loss) by the scale."""
        return _mul_floating(tree, self.loss_scale)

    def unscale(self, tree):
        """Divide the floating leaves of ``tree`` (the gradients) by the scale."""
        return _mul_floating(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite) -> "StaticLossScale":
        """Return ``self``: a static scale never changes."""
        _finite_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_LossScaleMixin):
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    Arguments:
        loss_scale: float32 scalar, the current scale.
        counter: int32 scalar, finite steps since the scale last changed.
        growth_interval: after this many consecutive finite steps the scale is
            multiplied by ``growth_factor`` (capped at ``max_scale``).
        growth_factor: factor (>= 1) applied on growth.
        backoff_factor: factor in (0, 1] applied when gradients are not finite
            (floored at ``min_scale``).
        min_scale, max_scale: bounds on the scale, ``0 < min_scale <= max_scale``.

    The hyperparameters are static pytree metadata: they survive ``jit``,
    ``tree_map`` and ``lax.scan`` (jmp's version lost ``min_loss_scale``).
    """

    loss_scale: Any
    counter: Any = 0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0 ** 24

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("loss_scale", _as_scalar(self.loss_scale, jnp.float32, "loss_scale"))
        set_("counter", _as_scalar(self.counter, jnp.int32, "counter"))
        if isinstance(self.growth_interval, bool) or int(self.growth_interval) != self.growth_interval \
                or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {self.growth_interval!r}")
        set_("growth_interval", int(self.growth_interval))
        for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            set_(name, float(getattr(self, name)))
        if not 1.0 <= self.growth_factor < float("inf"):
            raise ValueError(f"growth_factor must be finite and >= 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor <= 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1], got {self.backoff_factor}")
        if not 0.0 < self.min_scale <= self.max_scale < float("inf"):
            raise ValueError("need 0 < min_scale <= max_scale < inf, got "
                             f"min_scale={self.min_scale}, max_scale={self.max_scale}")

    def scale(self, tree):
        """Multiply the floating leaves of ``tree`` (the loss) by the scale."""
        return _mul_floating(tree, self.loss_scale)

    def unscale(self, tree):
        """Divide the floating leaves of ``tree`` (the gradients) by the scale."""
        return _mul_floating(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite) -> "DynamicLossScale":
        """The next loss scale after a step whose gradients were (not) finite.

        Arguments:
            grads_finite: boolean scalar, e.g. ``all_finite(grads)``.
        """
        finite = _finite_flag(grads_finite)
        grow = self.counter + 1 >= self.growth_interval
        grown = jnp.where(grow, jnp.minimum(self.loss_scale * self.growth_factor, self.max_scale),
                          self.loss_scale)
        backed_off = jnp.maximum(self.loss_scale * self.backoff_factor, self.min_scale)
        new_scale = jnp.where(finite, grown, backed_off).astype(jnp.float32)
        new_counter = jnp.where(finite & ~grow, self.counter + 1, 0).astype(jnp.int32)
        return dataclasses.replace(self, loss_scale=new_scale, counter=new_counter)


_register(NoOpLossScale, (), ())
_register(StaticLossScale, ("loss_scale",), ())
_register(DynamicLossScale, ("loss_scale", "counter"),
          ("growth_interval", "growth_factor", "backoff_factor", "min_scale", "max_scale"))

_KIND_OF = {NoOpLossScale: "none", StaticLossScale: "static", DynamicLossScale: "dynamic"}
_LOSS_SCALE_KINDS = {"none": NoOpLossScale, "noop": NoOpLossScale,
                     "static": StaticLossScale, "dynamic": DynamicLossScale}
LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


def make_loss_scale(kind: str | None, **hparams) -> LossScale:
    """Build a loss scale from config values.

    Arguments:
        kind: ``"none"`` (or ``"noop"``/None), ``"static"`` or ``"dynamic"``;
            ``Policy.default_loss_scale`` gives the one a policy wants.
        **hparams: ``scale`` (initial/fixed scale, default ``2**15``) for
            static and dynamic; ``growth_interval``, ``growth_factor``,
            ``backoff_factor``, ``min_scale``, ``max_scale`` for dynamic
            (defaults as in :class:`DynamicLossScale`).
    """
    key = "none" if kind is None else str(kind).strip().lower()
    if key not in _LOSS_SCALE_KINDS:
        raise ValueError(f"unknown loss scale kind {kind!r}; expected one of "
                         f"{sorted(_LOSS_SCALE_KINDS)} or None")
    cls = _LOSS_SCALE_KINDS[key]
    allowed = () if cls is NoOpLossScale else ("scale",) + cls._meta_fields
    unknown = sorted(set(hparams) - set(allowed))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for loss scale {key!r}; "
                         f"allowed: {list(allowed)}")
    if cls is NoOpLossScale:
        return NoOpLossScale()
    hparams = dict(hparams)
    scale = float(hparams.pop("scale", 2.0 ** 15))
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"loss scale must be positive and finite, got {scale}")
    return cls(scale, **hparams)


def loss_scale_from_state_dict(d: Mapping[str, Any]) -> LossScale:
    """Rebuild any loss scale from its ``to_state_dict()`` output (dispatches on ``"kind"``)."""
    if "kind" not in d:
        raise ValueError("loss scale state dict has no 'kind' entry")
    kind = str(np.asarray(d["kind"]))
    if kind not in _LOSS_SCALE_KINDS:
        raise ValueError(f"unknown loss scale kind {kind!r} in state dict")
    return _LOSS_SCALE_KINDS[kind].from_state_dict(d)


def current_scale(loss_scale: LossScale) -> jax.Array:
    """The scale as a float32 scalar (1.0 for :class:`NoOpLossScale`), for metrics."""
    if isinstance(loss_scale, NoOpLossScale):
        return jnp.ones((), jnp.float32)
    return jnp.asarray(loss_scale.loss_scale, jnp.float32)


def all_finite(tree) -> jax.Array:
    """Boolean scalar: no floating leaf of ``tree`` holds a NaN or an infinity.

    Non-floating leaves (integers, booleans, PRNG keys) are ignored; an empty
    tree is finite.
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not flags:
        return jnp.array(True)
    return jnp.all(jnp.stack(flags))


def select_tree(pred, on_true, on_false):
    """Leafwise ``on_true if pred else on_false`` for two trees of the same
    structure, shapes and dtypes (keeps params, optimiser and model state
    unchanged on a skipped step).

    Arguments:
        pred: boolean scalar.
        on_true, on_false: pytrees with identical structure, leaf shapes and dtypes.
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(f"select_tree needs a boolean scalar predicate, got {pred.dtype} "
                         f"array of shape {pred.shape}")
    true_leaves, true_def = jax.tree_util.tree_flatten(on_true)
    false_leaves, false_def = jax.tree_util.tree_flatten(on_false)
    if true_def != false_def:
        raise ValueError(f"select_tree: tree structures differ:\n{true_def}\nvs\n{false_def}")
    out = []
    for a, b in zip(true_leaves, false_leaves):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"select_tree: leaf {a.dtype}{list(a.shape)} vs "
                             f"{b.dtype}{list(b.shape)}")
        out.append(jnp.where(pred, a, b))
    return jax.tree_util.tree_unflatten(true_def, out)
