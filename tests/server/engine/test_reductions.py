"""Every reduction equals the same statistic computed in numpy from full per-example tensors:
the engine's own, and the Keras-only oracle's (tests/oracle.py) where it matters most."""

from __future__ import annotations

import re
from typing import Any

import keras
import numpy as np
import pytest
from scipy.stats import chi2

from pergrad.server.engine import Engine
from pergrad.server.engine.group import Job
from pergrad.server.engine.reductions import ReductionRegistry, default_reductions
from pergrad.server.errors import InvalidArgument
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.wire.catalogue import CATALOGUE, NONE
from pergrad.wire.text import quoted
from tests import oracle, spec_random
from tests.helpers import assert_close, batch_for, computed_together, tabular_model

MODELS = ["mnist_mlp", "mnist_cnn", "transformer_block", "tabular"]
_ENGINES: dict[str, Engine] = {}


def _engine(name: str) -> Engine:
    if name not in _ENGINES:
        model = tabular_model() if name == "tabular" else BUILTIN_MODELS[name]()
        loss = None if name == "tabular" else LOSS
        _ENGINES[name] = Engine(model, loss=loss, jit_compile=False)
    return _ENGINES[name]


def _batch(engine: Engine, size: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (size, *engine.input_spec.shape)
    if engine.input_spec.dtype.kind == "i":
        x = rng.integers(0, 1000, size=shape).astype(np.int32)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    return x, rng.integers(0, engine.label_spec.num_classes, size=size).astype(np.int32)


def _oracle(engine: Engine, x, y) -> dict[str, np.ndarray]:
    """The oracle's per-example gradients under the model's Keras loss."""
    loss = getattr(engine.model, "loss", None) or LOSS  # the .keras model's compiled loss
    return oracle.per_example(engine.model, loss, x, y)[1]


def _full(engine: Engine, x, y) -> dict[str, np.ndarray]:
    return {
        k: v.astype(np.float64) for k, v in engine.per_example_gradients(x, y).gradients.items()
    }


def _flat_norms(full: dict[str, np.ndarray]) -> np.ndarray:
    return np.sqrt(sum(np.square(g.reshape(len(g), -1)).sum(1) for g in full.values()))


@pytest.mark.parametrize("name", MODELS)
def test_norms_match_norms_of_full_tensors(name: str) -> None:
    engine = _engine(name)
    x, y = _batch(engine)
    full = _full(engine, x, y)
    result = engine.per_example_gradients(x, y, reduction="norms")
    assert_close({"norms": result.norms}, {"norms": _flat_norms(full)})
    expected = {k: np.sqrt(np.square(g.reshape(len(g), -1)).sum(1)) for k, g in full.items()}
    assert_close(result.variable_norms, expected)
    assert result.gradients == {}


@pytest.mark.parametrize("name", MODELS)
def test_clipped_sum_matches_clipping_full_tensors(name: str) -> None:
    engine = _engine(name)
    x, y = _batch(engine)
    full = _full(engine, x, y)
    norms = _flat_norms(full)
    middle = np.sort(norms)[len(norms) // 2 - 1 : len(norms) // 2 + 1]
    max_norm = float(middle.mean())  # between two norms: no example sits on the bound
    result = engine.per_example_gradients(x, y, reduction="clipped_sum", max_norm=max_norm)
    scale = np.minimum(1.0, max_norm / norms)
    expected = {k: np.tensordot(scale, g, axes=1) for k, g in full.items()}
    assert_close(result.clipped_sum, expected)
    assert result.num_clipped == int((norms > max_norm).sum()) > 0
    assert_close({"norms": result.norms}, {"norms": norms})


# How far from the bound, relative, the median example's norm sits: far beyond float32's
# rounding of a norm (~1e-7), well within the 1e-3 where clipping barely changes anything.
NEAR_BOUND = 5e-4
SIDES = {"just_below_the_bound": 1 + NEAR_BOUND, "just_above_the_bound": 1 - NEAR_BOUND}


def _bound_near_the_median(norms: np.ndarray, side: str) -> tuple[float, int]:
    """(max_norm, the median example): max_norm is the median oracle norm moved by
    NEAR_BOUND so that the median example sits on `side` of it."""
    median = int(np.argsort(norms)[len(norms) // 2])
    max_norm = float(norms[median] * SIDES[side])
    # No norm so near the bound that float32 rounding could put it on the other side.
    assert np.min(np.abs(norms / max_norm - 1)) > 1e-5
    return max_norm, median


@pytest.mark.parametrize("side", sorted(SIDES))
@pytest.mark.parametrize("name", MODELS)
def test_clipped_sum_with_norms_straddling_the_bound_matches_oracle(name: str, side: str) -> None:
    """About half the examples clipped, one within 1e-3 of the bound: num_clipped, the norms
    and sum_b min(1, C / ||g_b||) g_b against float64 numpy on the oracle's gradients."""
    engine = _engine(name)
    x, y = _batch(engine)
    grads = _oracle(engine, x, y)
    norms = oracle.per_example_norms(grads)
    max_norm, _ = _bound_near_the_median(norms, side)
    result = engine.per_example_gradients(x, y, reduction="clipped_sum", max_norm=max_norm)
    assert result.num_clipped == int(np.sum(norms > max_norm))
    assert 0 < result.num_clipped < len(norms)
    assert_close({"norms": result.norms}, {"norms": norms})
    assert_close(result.clipped_sum, oracle.clipped_sum(grads, max_norm))


@pytest.mark.parametrize("side", sorted(SIDES))
@pytest.mark.parametrize("name", MODELS)
def test_an_example_at_the_bound_is_scaled_by_min_of_1_and_bound_over_norm(
    name: str, side: str
) -> None:
    """The median example alone, NEAR_BOUND from the bound: just above it, its gradient
    scaled by C / ||g|| (1 - 5e-4, fifty times the tolerance away from 1); below it, not."""
    engine = _engine(name)
    x, y = _batch(engine)
    grads = _oracle(engine, x, y)
    norms = oracle.per_example_norms(grads)
    max_norm, m = _bound_near_the_median(norms, side)
    one = engine.per_example_gradients(
        x[m : m + 1], y[m : m + 1], reduction="clipped_sum", max_norm=max_norm
    )
    scale = min(1.0, max_norm / norms[m])
    assert one.num_clipped == int(scale < 1) == int(side == "just_above_the_bound")
    assert_close(one.clipped_sum, {k: scale * g[m].astype(np.float64) for k, g in grads.items()})


@pytest.mark.parametrize("name", MODELS)
def test_moments_match_sums_of_full_tensors(name: str) -> None:
    engine = _engine(name)
    x, y = _batch(engine)
    full = _full(engine, x, y)
    result = engine.per_example_gradients(x, y, reduction="moments")
    assert_close(result.sum, {k: g.sum(0) for k, g in full.items()})
    assert_close(result.sum_squares, {k: np.square(g).sum(0) for k, g in full.items()})


@pytest.mark.parametrize("name", MODELS)
def test_dots_match_dots_of_full_tensors(name: str) -> None:
    engine = _engine(name)
    x, y = _batch(engine)
    full = _full(engine, x, y)
    rng = np.random.default_rng(3)
    reference = {
        k: rng.standard_normal((3, *g.shape[1:])).astype(np.float32) for k, g in full.items()
    }
    result = engine.per_example_gradients(x, y, reduction="dot", reference=reference)
    expected = sum(
        g.reshape(len(g), -1) @ reference[k].reshape(3, -1).T.astype(np.float64)
        for k, g in full.items()
    )
    assert_close({"dots": result.dots}, {"dots": expected})


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("name", MODELS)
def test_projections_match_the_matrix_the_wire_contract_defines(name: str, kind: str) -> None:
    """R_v made entry by entry from the proto's text (tests/spec_random.py), as another
    client would make it from the seed."""
    engine = _engine(name)
    x, y = _batch(engine)
    full = _full(engine, x, y)
    result = engine.per_example_gradients(x, y, reduction="project", dim=8, seed=5, projection=kind)
    matrices = {
        v.path: spec_random.projection_matrix(5, index, tuple(v.shape), 8, kind)
        for index, v in enumerate(engine.model.trainable_variables)
    }
    expected = sum(g.reshape(len(g), -1) @ matrices[k].T for k, g in full.items()) / np.sqrt(8)
    assert_close({"projections": result.projections}, {"projections": expected})


def test_projection_preserves_norms_on_average() -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine, size=16)
    result = engine.per_example_gradients(x, y, reduction="project", dim=4096, seed=1)
    norms = engine.per_example_gradients(x, y, reduction="norms").norms
    ratio = np.linalg.norm(result.projections, axis=1) / norms
    # JL with k=4096 rows: each ratio is within a few percent of 1.
    assert np.all(np.abs(ratio - 1) < 0.1), ratio


def _squared_projections(engine: Engine, x: Any, y: Any, seed: int, **options) -> np.ndarray:
    result = engine.per_example_gradients(x, y, reduction="project", seed=seed, **options)
    return np.sum(np.square(result.projections.astype(np.float64)), axis=1)


def test_gaussian_projection_preserves_squared_norms_within_chi_square_bounds() -> None:
    """Dense Gaussian R (every variable of mnist_cnn but the Dense kernels, whose rows are
    Kronecker products): for each example, dim ||R g / sqrt(dim)||^2 / ||g||^2 is
    chi-square with dim degrees of freedom (mean dim: the expectation is ||g||^2, variance
    2 dim), and independent seeds add up to chi-square with seeds x dim. Its two-sided
    1e-9 quantiles (over all examples) bound it: about +-10% of the mean here."""
    engine = _engine("mnist_cnn")
    dense = [v.path for v in engine.model.trainable_variables if len(v.shape) != 2]
    x, y = _batch(engine, size=4)
    grads = _oracle(engine, x, y)
    squared = oracle.per_example_norms({name: grads[name] for name in dense}) ** 2
    dim, seeds = 512, range(16)
    options = {"dim": dim, "projection": "gaussian", "variables": dense}
    total = sum(_squared_projections(engine, x, y, seed, **options) for seed in seeds)
    statistic, dof = dim * total / squared, dim * len(seeds)
    tail = 1e-9 / (2 * len(x))
    low, high = chi2.ppf(tail, dof), chi2.isf(tail, dof)
    assert np.all((low < statistic) & (statistic < high)), (statistic / dof, low / dof, high / dof)


def test_same_seed_gives_the_same_projection_on_another_engine() -> None:
    first = _engine("mnist_cnn")
    second = Engine(BUILTIN_MODELS["mnist_cnn"](), loss=LOSS, jit_compile=False, slice_bytes=1)
    x, y = _batch(first)
    a = first.per_example_gradients(x, y, reduction="project", dim=32, seed=9)
    b = second.per_example_gradients(x, y, reduction="project", dim=32, seed=9)
    c = first.per_example_gradients(x, y, reduction="project", dim=32, seed=10)
    assert_close({"p": a.projections}, {"p": b.projections})
    assert not np.allclose(a.projections, c.projections)


def _noise(engine: Engine, x, y, **options) -> dict[str, np.ndarray]:
    """The noise a clipped sum added: the result less the same sum without noise."""
    noisy = engine.per_example_gradients(x, y, reduction="clipped_sum", max_norm=0.5, **options)
    clean = engine.per_example_gradients(x, y, reduction="clipped_sum", max_norm=0.5)
    return {k: v.astype(np.float64) - clean.clipped_sum[k] for k, v in noisy.clipped_sum.items()}


def test_seeded_noise_is_reproducible_and_the_wire_contracts() -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine)
    first = _noise(engine, x, y, noise_multiplier=2.0, seed=4)
    again = _noise(engine, x, y, noise_multiplier=2.0, seed=4)
    for name, value in first.items():
        assert value.tobytes() == again[name].tobytes()
    bias = next(v for v in engine.variables if v.name == "logits/bias")
    k = spec_random.key(4, bias.index, 2)
    standard = np.array([spec_random.gaussian(k, n) for n in range(10)], np.float32)
    noisy, clean = (
        engine.per_example_gradients(
            x, y, reduction="clipped_sum", max_norm=0.5, **noise
        ).clipped_sum["logits/bias"]
        for noise in ({"noise_multiplier": 2.0, "seed": 4}, {})
    )
    assert noisy.tobytes() == (clean + np.float32(2.0 * 0.5) * standard).tobytes()


def test_seeded_noise_follows_the_variables_index_in_the_model_whatever_is_selected() -> None:
    """The proto keys a variable's noise by its position in ModelInfo.variables: selecting
    only the last variable keeps its stream (not that of position 0 of the selection)."""
    engine = _engine("mnist_mlp")
    x, y = _batch(engine)
    bias = engine.variables[-1]
    assert bias.index > 0
    k = spec_random.key(4, bias.index, 2)
    standard = np.array([spec_random.gaussian(k, n) for n in range(10)], np.float32)
    noisy, clean = (
        engine.per_example_gradients(
            x, y, reduction="clipped_sum", max_norm=0.5, variables=[bias.name], **noise
        ).clipped_sum[bias.name]
        for noise in ({"noise_multiplier": 2.0, "seed": 4}, {})
    )
    assert noisy.tobytes() == (clean + np.float32(2.0 * 0.5) * standard).tobytes()


@pytest.mark.parametrize("seed", [4, None])
def test_noise_has_the_requested_std(seed: int | None) -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine)
    noise = _noise(engine, x, y, noise_multiplier=2.0, seed=seed)["hidden/kernel"]
    # 100,352 draws: the sample std is within 1% of 2.0 * 0.5 with overwhelming probability.
    assert abs(noise.std() - 1.0) < 0.01
    assert abs(noise.mean()) < 0.01


def test_unseeded_noise_is_fresh_on_every_call_and_not_seed_zeros() -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine)
    first = _noise(engine, x, y, noise_multiplier=1.0)["logits/bias"]
    second = _noise(engine, x, y, noise_multiplier=1.0)["logits/bias"]
    seed_zero = _noise(engine, x, y, noise_multiplier=1.0, seed=0)["logits/bias"]
    assert not np.allclose(first, second, atol=1e-3)
    assert not np.allclose(first, seed_zero, atol=1e-3)


def test_variables_filter_limits_every_output() -> None:
    engine = _engine("mnist_cnn")
    x, y = _batch(engine)
    full = _full(engine, x, y)
    chosen = ["logits/kernel", "logits/bias"]
    result = engine.per_example_gradients(x, y, reduction="norms", variables=chosen)
    assert sorted(result.variable_norms) == sorted(chosen)
    assert_close({"norms": result.norms}, {"norms": _flat_norms({k: full[k] for k in chosen})})
    grads = engine.per_example_gradients(x, y, variables=["logits/bias"]).gradients
    assert list(grads) == ["logits/bias"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduction": "median"}, "reduction: unknown 'median'"),
        ({"reduction": "clipped_sum"}, "max_norm: clipped_sum needs a finite positive bound"),
        ({"reduction": "clipped_sum", "max_norm": -1.0}, "positive bound, got -1.0"),
        ({"reduction": "clipped_sum", "max_norm": float("inf")}, "finite positive bound"),
        (
            {"reduction": "clipped_sum", "max_norm": 1.0, "noise_multiplier": float("nan")},
            "noise_multiplier: clipped_sum needs 0 <= noise_multiplier < inf, got nan",
        ),
        ({"reduction": "norms", "max_norm": 1.0}, "not options of reduction 'norms'"),
        ({"max_norm": 1.0}, "not options of reduction 'none'"),
        ({"reduction": "project"}, "dim: project needs 1 <= dim"),
        ({"reduction": "project", "dim": 4, "projection": "sparse"}, "unknown projection 'sparse'"),
        ({"reduction": "dot", "reference": {}}, "missing ['hidden/bias'"),
        ({"variables": ["nope"]}, "variables: unknown ['nope']"),
    ],
)
def test_bad_reduction_options_are_refused(kwargs: dict, message: str) -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine, size=2)
    with pytest.raises(InvalidArgument) as err:
        engine.per_example_gradients(x, y, **kwargs)
    assert message in str(err.value)


def test_a_filter_naming_many_unknown_variables_quotes_a_few_short() -> None:
    """A request may name a million variables, each long: the message quotes the first
    few, cut short, and says how many more (sorting and quoting all took seconds)."""
    engine = _engine("mnist_mlp")
    names = [f"{i:07d}" + "x" * 200 for i in range(100_000)]
    with pytest.raises(InvalidArgument) as err:
        engine.passes.select(names)
    message = str(err.value)
    assert message.startswith(f"variables: unknown [{quoted(names[0])}, ")
    assert f"{quoted(names[2])}] and 99997 more; the model has [" in message
    assert len(message) < 1000


def test_noise_whose_std_overflows_float32_is_refused() -> None:
    engine = _engine("mnist_mlp")
    x, y = _batch(engine)
    with pytest.raises(InvalidArgument, match="overflows float32"):
        engine.per_example_gradients(
            x, y, reduction="clipped_sum", max_norm=1e300, noise_multiplier=1.0, seed=1
        )


def _conv_by_both_algebras() -> keras.Model:
    """conv1 has many positions and a small kernel (T (K + C) > K C: its kernel is formed);
    conv2 few positions and a large one (T (K + C) < K C: Gram matrices over positions)."""
    init = keras.initializers.GlorotUniform
    x = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", kernel_initializer=init(1), name="conv1")(x)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Conv2D(64, 3, strides=2, kernel_initializer=init(2), name="conv2")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(5, kernel_initializer=init(3))(h))


def _ghost(layer: keras.layers.Layer) -> bool:
    positions = int(np.prod(layer.output.shape[1:-1]))
    *window, channels_in, channels_out = layer.kernel.shape
    inputs = int(np.prod(window)) * channels_in
    return positions * (inputs + channels_out) < inputs * channels_out


@pytest.mark.parametrize("route", ["in_pass", "shared_pass"])
def test_conv_norms_and_clipped_sums_by_either_algebra_match_oracle(route: str) -> None:
    """Norms and clipped sums of conv kernels, one by Gram matrices and one formed, in the
    compiled pass and in numpy (a shared pass's route), against the oracle."""
    model = _conv_by_both_algebras()
    assert [_ghost(model.get_layer(n)) for n in ("conv1", "conv2")] == [False, True]
    engine = Engine(model, loss=LOSS, jit_compile=False)
    x, y = batch_for((12, 12, 3), 5, size=9)
    grads = oracle.per_example(model, LOSS, x, y)[1]
    norms = oracle.per_example_norms(grads)
    max_norm = float(np.sort(norms)[3:5].mean())  # between two norms, none on the bound
    options = {"reduction": "clipped_sum", "max_norm": max_norm}
    if route == "in_pass":
        result = engine.per_example_gradients(x, y, **options)
    else:
        job = Job(engine.batch(x, y), engine.passes.sink(len(x), **options))
        (result,) = computed_together(engine, [job], granule=16)
    assert_close({"norms": result.norms}, {"norms": norms})
    assert_close(result.clipped_sum, oracle.clipped_sum(grads, max_norm))
    assert result.num_clipped == int(np.sum(norms > max_norm))


def test_the_default_registry_computes_every_catalogued_reduction() -> None:
    assert default_reductions().names() == sorted(set(CATALOGUE.names) - {NONE})


def test_an_engine_computes_only_the_reductions_of_its_registry() -> None:
    engine = Engine(tabular_model(), jit_compile=False, reductions=ReductionRegistry({}))
    x, y = batch_for((12,), 5, 2)
    with pytest.raises(KeyError, match="no engine class for reduction 'norms'"):
        engine.per_example_gradients(x, y, reduction="norms")


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        (np.full((1, 5), np.nan), "holds NaN or infinity"),
        (np.full((1, 5), 1e39), "values outside the range of float32"),
        (np.float64(1.0), "a [K, *shape] tensor, got a scalar"),
    ],
    ids=["nan", "beyond_float32", "scalar"],
)
def test_in_process_dot_references_are_checked_as_the_wire_checks_them(
    reference: Any, message: str
) -> None:
    engine = Engine(tabular_model(), jit_compile=False)
    x, y = batch_for((12,), 5, 2)
    with pytest.raises(InvalidArgument, match=re.escape(f"reference['head/bias']: {message}")):
        engine.per_example_gradients(
            x, y, reduction="dot", variables=["head/bias"], reference={"head/bias": reference}
        )


@pytest.mark.parametrize(
    ("reduction", "options", "inside"),
    [("norms", {}, True), ("clipped_sum", {"max_norm": 1.0}, True), ("moments", {}, False)],
)
def test_norms_and_clipped_sums_are_computed_inside_the_pass(
    reduction: str, options: dict, inside: bool
) -> None:
    """Their per-example gradients are never formed (docs/architecture.md, the engine
    step of a request's path); other reductions are fed the gradients."""
    sink = Engine(tabular_model(), jit_compile=False).passes.sink(4, reduction=reduction, **options)
    assert (sink.in_pass is not None) == inside
