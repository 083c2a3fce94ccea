"""Combinators: layers made of layers — :func:`serial`, :func:`residual`, :func:`parallel`,
:func:`gate`; and :func:`whole_model`, which marks a layer as a whole model.

Children are named like PyTorch modules: an item is a Layer (named by its
position, ``"0"``, ``"1"``, ... as in ``nn.Sequential``) or a ``(name, Layer)``
pair.  A combinator's params and state are ``{child_name: child_tree}`` with
empty child trees left out, so a ``serial(Conv2D(...), Relu(), Conv2D(...))``
has params ``{"0": ..., "2": ...}``: the same keys PyTorch's state dict uses.
Children's ``init`` runs inside ``base.name_scope(child_name)`` so that
``record_layers`` reports dotted paths; their rng keys come from
``base.split_rng`` (one per child, by position).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxcnn.layers import fusion, norm
from jaxcnn.layers.base import Layer, current_path, name_scope, split_rng
from jaxcnn.precision import as_policy, cast_for

_NOTE = "while initialising layer "
_APPLY_NOTE = "while applying layer "


def _named(items, what: str, start: int = 0) -> list[tuple[str, Layer]]:
    """``(name, Layer)`` pairs; unnamed items get their position ``start + i``."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Layer):  # before the pair test: a Layer is a tuple too
            out.append((str(start + i), item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Layer):
            if not isinstance(item[0], str) or not item[0] or "." in item[0]:
                raise ValueError(f"{what}: child name must be a non-empty string without '.', "
                                 f"got {item[0]!r}")
            out.append(item)
        else:
            raise TypeError(f"{what}: item {start + i} must be a Layer or a (name, Layer) pair, "
                            f"got {type(item).__name__}")
    return out


def _check_unique(children, what: str):
    seen = set()
    for name, _ in children:
        if name in seen:
            raise ValueError(f"{what}: duplicate child name {name!r}")
        seen.add(name)


def _init_child(name, layer, key, input_shape, params, state):
    """Init one child under its name; store its non-empty trees; return its output shape."""
    with name_scope(name):
        try:
            p, s, out_shape = layer.init(key, input_shape)
        except ValueError as e:
            # Say where in the model it failed, once (the innermost scope knows the full path).
            if not any(n.startswith(_NOTE) for n in getattr(e, "__notes__", ())):
                e.add_note(f"{_NOTE}{current_path()!r} with input shape {tuple(input_shape)}")
            raise
    if p:
        params[name] = p
    if s:
        state[name] = s
    return tuple(out_shape)


def _apply_child(name, layer, rng, params, state, x, train, policy, choices, new_state,
                 apply=None):
    """Apply one child under its name (so a layer's apply can name its path, as its init can),
    through ``apply`` when given (else its own)."""
    with name_scope(name):
        try:
            y, s = (apply or layer.apply)(params.get(name, {}), state.get(name, {}), x,
                                          train=train, rng=rng, policy=policy, choices=choices)
        except ValueError as e:
            path = current_path()  # once, and not when the message itself names it
            if not any(n.startswith(_APPLY_NOTE) for n in getattr(e, "__notes__", ())) \
                    and f"at {path!r}" not in str(e):
                e.add_note(f"{_APPLY_NOTE}{path!r} to input shape {tuple(getattr(x, 'shape', ()))}")
            raise
    if s:
        new_state[name] = s
    return y


def _apply_children(children, rngs, params, state, x, train, policy, choices, new_state):
    """``children`` applied one after the other, each through its own ``apply``, except that
    in training a BatchNorm followed by a ReLU runs as one (:func:`jaxcnn.layers.norm.with_relu`:
    the ReLU folded into BatchNorm's backward), under the BatchNorm's name (a ReLU has no
    parameters or state)."""
    i = 0
    while i < len(children):
        name, layer = children[i]
        fold = (train and layer.kind == "batch_norm" and i + 1 < len(children)
                and children[i + 1][1].kind == "relu")
        x = _apply_child(name, layer, rngs[i], params, state, x, train, policy, choices,
                         new_state, apply=norm.with_relu(layer) if fold else None)
        i += 2 if fold else 1
    return x


def apply_in_turn(children, params, state, x, *, train=False, rng=None, policy=None,
                  choices=None):
    """``(y, new_state)`` of ``children`` (``(name, Layer)`` pairs) applied one after the
    other (a :func:`serial` without its Conv -> BatchNorm fusion)."""
    new_state = {}
    x = _apply_children(children, split_rng(rng, len(children)), params, state, x, train,
                        policy, choices, new_state)
    return x, new_state


def serial(*layers) -> Layer:
    """Apply layers one after the other, like ``torch.nn.Sequential``.

    Arguments:
        *layers: each a Layer or a ``(name, Layer)`` pair.

    Returns:
        A Layer of kind ``"serial"``; ``serial()`` is the identity.
    """
    children = _named(layers, "serial")
    _check_unique(children, "serial")
    n = len(children)
    chains = fusion.has_chain(children)

    def init(key, input_shape):
        params, state, shape = {}, {}, tuple(int(d) for d in input_shape)
        for (name, layer), k in zip(children, split_rng(key, n)):
            shape = _init_child(name, layer, k, shape, params, state)
        return params, state, shape

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        if chains and fusion.active(choices, train):  # Conv -> BatchNorm [-> ReLU] chains
            new_state = {}
            x = fusion.apply_chain(children, split_rng(rng, n), params, state, x, train=train,
                                   policy=policy, choices=choices, new_state=new_state,
                                   apply_child=_apply_child)
            return x, new_state
        return apply_in_turn(children, params, state, x, train=train, rng=rng, policy=policy,
                             choices=choices)

    return Layer(init, apply, "serial", {}, tuple(children))


def residual(*layers, shortcut: Layer | None = None, shortcut_name: str = "shortcut",
             activation: Layer | None = None) -> Layer:
    """``y = activation(main(x) + shortcut(x))``, a residual block.

    The main layers are named like :func:`serial`'s children but at the
    residual's own level, so ``residual(("conv1", ...), ("bn1", ...), ("relu", ...),
    ("conv2", ...), ("bn2", ...), shortcut=serial(conv, bn),
    shortcut_name="downsample", activation=Relu())`` has torchvision's
    BasicBlock names ``conv1, bn1, conv2, bn2, downsample.0, downsample.1``.
    Under a policy both branches are cast to the compute dtype before the sum.

    Arguments:
        *layers: the main branch, each a Layer or a ``(name, Layer)`` pair.
        shortcut: Layer for the skip branch; None means the identity.
        shortcut_name: key of the shortcut's params/state.
        activation: Layer applied after the sum (named ``"activation"``), or None.

    Returns:
        A Layer of kind ``"residual"``. Raises ``ValueError`` at ``init`` when the
        two branches' output shapes differ.
    """
    main = _named(layers, "residual")
    chains = fusion.has_chain(main)
    if not main:
        raise ValueError("residual: needs at least one main-branch layer")
    extra = []
    if shortcut is not None:
        extra += _named([(shortcut_name, shortcut)], "residual")
    if activation is not None:
        extra += _named([("activation", activation)], "residual")
    children = main + extra
    _check_unique(children, "residual")
    n = len(children)

    def init(key, input_shape):
        input_shape = tuple(int(d) for d in input_shape)
        params, state, shape = {}, {}, input_shape
        keys = split_rng(key, n)
        for (name, layer), k in zip(main, keys):
            shape = _init_child(name, layer, k, shape, params, state)
        sc_shape = input_shape
        if shortcut is not None:
            sc_shape = _init_child(shortcut_name, shortcut, keys[len(main)], input_shape,
                                   params, state)
        if sc_shape != shape:
            raise ValueError(f"residual at {current_path()!r}: main branch output {shape} does "
                             f"not match shortcut output {sc_shape} (input {input_shape})")
        if activation is not None:
            shape = _init_child("activation", activation, keys[-1], shape, params, state)
        return params, state, shape

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        new_state, rngs = {}, split_rng(rng, n)
        y = x
        if chains and fusion.active(choices, train):  # Conv -> BatchNorm [-> ReLU] chains
            y = fusion.apply_chain(main, rngs[:len(main)], params, state, x, train=train,
                                   policy=policy, choices=choices, new_state=new_state,
                                   apply_child=_apply_child)
        else:
            y = _apply_children(main, rngs, params, state, x, train, policy, choices, new_state)
        s = x
        if shortcut is not None:
            s = _apply_child(shortcut_name, shortcut, rngs[len(main)], params, state, x, train,
                             policy, choices, new_state)
        y, s = cast_for(policy, "residual", (y, s))
        y = y + s
        if activation is not None:
            y = _apply_child("activation", activation, rngs[-1], params, state, y, train,
                             policy, choices, new_state)
        return y, new_state

    return Layer(init, apply, "residual", dict(shortcut_name=shortcut_name), tuple(children))


def parallel(*layers, combine: str = "concat") -> Layer:
    """Feed the same input to every branch and combine their outputs.

    Arguments:
        *layers: the branches, each a Layer or a ``(name, Layer)`` pair.
        combine: ``"concat"`` (along the last, channel axis; other axes must
            agree) or ``"add"`` (shapes must agree). Under a policy the branch
            outputs are cast to the compute dtype first.

    Returns:
        A Layer of kind ``"parallel"``.
    """
    if combine not in ("concat", "add"):
        raise ValueError(f"parallel: combine must be 'concat' or 'add', got {combine!r}")
    children = _named(layers, "parallel")
    if not children:
        raise ValueError("parallel: needs at least one branch")
    _check_unique(children, "parallel")
    n = len(children)

    def init(key, input_shape):
        input_shape = tuple(int(d) for d in input_shape)
        params, state = {}, {}
        shapes = [_init_child(name, layer, k, input_shape, params, state)
                  for (name, layer), k in zip(children, split_rng(key, n))]
        if combine == "add":
            ok, out = all(s == shapes[0] for s in shapes), shapes[0]
        else:
            ok = all(s[:-1] == shapes[0][:-1] for s in shapes)
            out = shapes[0][:-1] + (sum(s[-1] for s in shapes),)
        if not ok:
            raise ValueError(f"parallel at {current_path()!r}: cannot {combine} branch outputs "
                             f"of shapes {shapes} (input {input_shape})")
        return params, state, out

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        new_state = {}
        outs = [_apply_child(name, layer, r, params, state, x, train, policy, choices, new_state)
                for (name, layer), r in zip(children, split_rng(rng, n))]
        outs = cast_for(policy, "parallel", outs)
        if combine == "add":
            return sum(outs[1:], outs[0]), new_state
        return jnp.concatenate(outs, axis=-1), new_state

    return Layer(init, apply, "parallel", dict(combine=combine), tuple(children))


def gate(*layers) -> Layer:
    """``y = x * body(x)``: the input rescaled by what its layers compute from
    it, as in squeeze-and-excitation (``body`` pools to ``(N, 1, 1, C)`` and the
    product broadcasts).  The children run one after the other like
    :func:`serial`'s and are named the same way.  Under a policy both factors
    are cast to the compute dtype before the product.

    Arguments:
        *layers: the body, each a Layer or a ``(name, Layer)`` pair.

    Returns:
        A Layer of kind ``"gate"``; output shape = input shape.  Raises
        ``ValueError`` at ``init`` when the body's output does not broadcast
        against the input to the input's shape.
    """
    children = _named(layers, "gate")
    if not children:
        raise ValueError("gate: needs at least one layer")
    _check_unique(children, "gate")
    n = len(children)

    def init(key, input_shape):
        input_shape = tuple(int(d) for d in input_shape)
        params, state, shape = {}, {}, input_shape
        for (name, layer), k in zip(children, split_rng(key, n)):
            shape = _init_child(name, layer, k, shape, params, state)
        ok = len(shape) == len(input_shape) and all(
            g in (1, d) for g, d in zip(shape, input_shape))
        if not ok:
            raise ValueError(f"gate at {current_path()!r}: body output {shape} does not "
                             f"broadcast to the input shape {input_shape}")
        return params, state, input_shape

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        new_state = {}
        g = x
        for (name, layer), r in zip(children, split_rng(rng, n)):
            g = _apply_child(name, layer, r, params, state, g, train, policy, choices, new_state)
        x, g = cast_for(policy, "gate", (x, g))
        return x * g, new_state

    return Layer(init, apply, "gate", {}, tuple(children))


def whole_model(layer: Layer) -> Layer:
    """``layer`` as a whole model: its ``apply`` casts the output to the policy's
    ``output_dtype`` (float32 under every preset), the model's end of the
    :class:`jaxcnn.precision.Policy` contract.

    A layer does not know whether it is the whole model or a part, so only this
    wrapper casts: every other layer returns its compute dtype, so that a
    bfloat16 network stays bfloat16 inside.  The zoo models
    (:func:`jaxcnn.models.get`) come wrapped; wrap a model you compose yourself.
    Its parts (``children``, what a pipeline stage or a spatial unit applies) are
    ``layer``'s, unwrapped: they return their compute dtype.

    Arguments:
        layer: the model.

    Returns:
        ``layer`` with the same ``init``, ``kind``, ``config`` and ``children``; its
        ``apply`` output (floating leaves) is cast to ``policy.output_dtype`` when
        a policy is given, and is ``layer``'s own without one.
    """
    inner = layer.apply

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        policy = as_policy(policy)
        y, new_state = inner(params, state, x, train=train, rng=rng, policy=policy,
                             choices=choices)
        return (y if policy is None else policy.cast_to_output(y)), new_state

    return layer._replace(apply=apply)
