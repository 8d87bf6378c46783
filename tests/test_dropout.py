"""Monte Carlo dropout: opt-in, seeded, and its mean and spread agree with the statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ffn_core import FFNConfig, MonteCarloPasses, build_ffn, mc_dropout

D_MODEL, D_FF = 16, 64


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_ffn(FFNConfig(D_MODEL, D_FF, "gelu", gated=True, dropout=0.1))


@pytest.fixture
def x():
    return torch.randn(2, 3, D_MODEL, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "config",
    [FFNConfig(D_MODEL, D_FF, "relu", dropout=0.5), FFNConfig(D_MODEL, D_FF, "gelu", gated=True, dropout=0.1)],
    ids=lambda c: f"{c.variant}-p{c.dropout}",
)
def test_the_serving_forward_pass_has_no_dropout(config, training, x, np_ffn, close):
    # config.dropout is only for mc_dropout: even in train mode, where torch's own dropout would
    # zero about a fraction p of the hidden units, forward is the plain formula.
    torch.manual_seed(0)
    model = build_ffn(config).train(training)
    assert model.training is training
    with torch.no_grad():
        y = model(x)
    params = {key: value.double().numpy() for key, value in model.state_dict().items()}
    close(y.numpy(), np_ffn(x.double().numpy(), params, config.activation))


def test_shapes_and_spread(model, x):
    mean, std = mc_dropout(model, x, passes=16, seed=0)
    assert mean.shape == std.shape == x.shape
    assert (std > 0).all()


def test_same_seed_same_result_other_seed_differs(model, x):
    a = mc_dropout(model, x, passes=8, seed=3)
    b = mc_dropout(model, x, passes=8, seed=3)
    c = mc_dropout(model, x, passes=8, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_p_zero_has_no_spread(model, x):
    mean, std = mc_dropout(model, x, passes=4, p=0.0, seed=0)
    assert torch.equal(std, torch.zeros_like(std))
    torch.testing.assert_close(mean, model(x))


def test_p_defaults_to_the_config():
    model = build_ffn(FFNConfig(D_MODEL, D_FF))  # dropout 0.0
    _, std = mc_dropout(model, torch.randn(3, D_MODEL), passes=4, seed=0)
    assert torch.equal(std, torch.zeros_like(std))


def test_mean_converges_and_std_matches_the_bernoulli_variance(model, x):
    """Each output is sum_k h_k m_k / q W2_jk + b2_j with m_k ~ Bernoulli(q), q = 1 - p.

    So its mean is the deterministic output and its variance is sum_k (h_k W2_jk)^2 p / q.
    """
    p, passes = 0.1, 4000
    mean, std = mc_dropout(model, x, passes=passes, p=p, seed=0)
    with torch.inference_mode():
        h = model.hidden(x).double().numpy()  # (2, 3, d_ff)
        y = model(x).double().numpy()
    w2 = model.layer2.weight.detach().double().numpy()  # (d_model, d_ff)
    expected_std = np.sqrt(np.einsum("...k,jk->...j", h**2, w2**2) * p / (1 - p))
    # 6 standard errors of the mean for every element: loose, and the seed makes it deterministic.
    assert np.all(np.abs(mean.double().numpy() - y) <= 6 * expected_std / np.sqrt(passes))
    np.testing.assert_allclose(std.double().numpy(), expected_std, rtol=0.1)
    # More passes, closer mean.
    few, _ = mc_dropout(model, x, passes=10, p=p, seed=0)
    assert np.abs(mean.numpy() - y).mean() < np.abs(few.numpy() - y).mean()


def test_leaves_the_model_alone(model, x):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    y = model(x)
    mc_dropout(model, x, passes=4, p=0.5, seed=0)
    assert torch.equal(model(x), y)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"passes": 1}, "passes"), ({"p": 1.0}, "dropout"), ({"p": -0.1}, "dropout")]
)
def test_bad_arguments(model, x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mc_dropout(model, x, **kwargs)


@pytest.mark.parametrize("slices", [[7], [1, 1, 1, 1, 1, 1, 1], [3, 4], [2, 100]])
def test_any_slicing_of_the_passes_gives_the_same_answer(model, x, slices):
    whole = mc_dropout(model, x, passes=7, p=0.3, seed=5)
    run = MonteCarloPasses(model, x, passes=7, p=0.3, seed=5)
    for size in slices:
        run.run(size)
    assert run.remaining == 0
    sliced = run.result()
    assert torch.equal(whole[0], sliced[0]) and torch.equal(whole[1], sliced[1])


def test_the_result_is_the_mean_and_std_of_the_masked_passes(model, x):
    """Against the same masks drawn here by hand and applied in float64 numpy."""
    p, passes, seed = 0.25, 6, 9
    mean, std = mc_dropout(model, x, passes=passes, p=p, seed=seed)
    with torch.inference_mode():
        hidden = model.hidden(x)
    generator = torch.Generator().manual_seed(seed)
    w2 = model.layer2.weight.detach().double().numpy()
    b2 = model.layer2.bias.detach().double().numpy()
    outputs = []
    for _ in range(passes):
        mask = torch.bernoulli(torch.full_like(hidden, 1 - p), generator=generator).double().numpy()
        outputs.append((hidden.double().numpy() * mask / (1 - p)) @ w2.T + b2)
    stacked = np.stack(outputs)
    np.testing.assert_allclose(mean.double().numpy(), stacked.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std.double().numpy(), stacked.std(axis=0, ddof=1), rtol=1e-4, atol=1e-6)


def test_the_result_before_every_pass_ran_is_refused(model, x):
    run = MonteCarloPasses(model, x, passes=3, p=0.1, seed=0)
    run.run(2)
    with pytest.raises(RuntimeError, match="1 of 3 passes"):
        run.result()
