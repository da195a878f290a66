"""The sampler (policies/sampling.py) as a distribution: temperature reshapes softmax(logits / T),
top_p keeps exactly the nucleus, top_k the k likeliest, min_p those near the likeliest,
temperature 0 (and T -> 0 with top_p 1) is greedy, the repetition penalty is vLLM's formula over
the prompt and the text, and the seed alone decides the draws."""
from __future__ import annotations

import numpy as np
import pytest

from socllm.policies.sampling import Sampler, SamplingParams

# softmax(LOGITS) = 0.5, 0.25, 0.15, 0.07, 0.03 (in a shuffled order: the sampler must sort)
PROBS = np.array([0.15, 0.5, 0.03, 0.25, 0.07])
LOGITS = np.log(PROBS).astype(np.float32) + 3.0
DRAWS = 20_000


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _freqs(params: SamplingParams, logits=LOGITS, n=DRAWS) -> np.ndarray:
    s = Sampler(params)
    counts = np.bincount([s(logits) for _ in range(n)], minlength=len(logits))
    return counts / n


def _within(freqs, probs, n=DRAWS, sigmas=5.0):
    """Each frequency within 5 standard deviations of its probability (binomial): a correct
    sampler fails this with probability < 1e-5 per token, whatever the seed."""
    sd = np.sqrt(probs * (1 - probs) / n)
    return np.all(np.abs(freqs - probs) <= sigmas * sd + 1e-12), np.abs(freqs - probs) / np.maximum(sd, 1e-12)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    want = _softmax(LOGITS.astype(np.float64) / temperature)
    ok, z = _within(_freqs(SamplingParams(temperature=temperature, seed=11)), want)
    assert ok, f"T={temperature}: deviations in standard deviations {z.round(1)}"


def test_temperature_changes_the_distribution():
    """The same logits at T 0.5 and 2: the top token's share moves far beyond sampling noise."""
    cold = _freqs(SamplingParams(temperature=0.5, seed=3))
    hot = _freqs(SamplingParams(temperature=2.0, seed=3))
    top = int(np.argmax(LOGITS))
    assert cold[top] > 0.7 and hot[top] < 0.4, (cold, hot)
    assert cold.argmax() == hot.argmax() == top


@pytest.mark.parametrize("top_p, kept", [(0.8, 3), (0.6, 2), (0.5, 1), (0.3, 1), (0.95, 4), (1.0, 5)])
def test_top_p_keeps_exactly_the_smallest_nucleus_reaching_p(top_p, kept):
    """The nucleus: the most probable tokens until their mass reaches top_p (0.5, 0.75, 0.9,
    0.97, 1.0 here). Tokens outside it are never drawn; those inside keep their relative
    probabilities."""
    order = np.argsort(-PROBS)
    nucleus, tail = order[:kept], order[kept:]
    f = _freqs(SamplingParams(temperature=1.0, top_p=top_p, seed=5))
    assert f[tail].sum() == 0, f"top_p={top_p}: drew {f[tail]} outside the nucleus"
    want = np.zeros_like(PROBS)
    want[nucleus] = PROBS[nucleus] / PROBS[nucleus].sum()
    ok, z = _within(f, want)
    assert ok, f"top_p={top_p}: deviations in standard deviations {z.round(1)}"
    assert (f[nucleus] > 0).all()


def test_top_p_applies_after_temperature():
    """At T=2 the distribution flattens (0.33, 0.24, 0.18, 0.13, 0.08 here) and top_p 0.8
    keeps four tokens, where at T=1 it keeps three."""
    flat = _softmax(LOGITS.astype(np.float64) / 2.0)
    order = np.argsort(-flat)
    assert np.cumsum(flat[order])[2] < 0.8 <= np.cumsum(flat[order])[3]
    f = _freqs(SamplingParams(temperature=2.0, top_p=0.8, seed=9))
    assert f[order[4]] == 0 and (f[order[:4]] > 0).all()


@pytest.mark.parametrize("temperature", [0.0, 1e-2, 1e-3])
def test_temperature_towards_zero_with_top_p_1_is_greedy(temperature):
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = rng.standard_normal(1000).astype(np.float32) * 3
        top = int(np.argmax(logits))
        logits[top] += 1.0               # a gap of at least 1: at T <= 0.01, e^-100 for the rest
        s = Sampler(SamplingParams(temperature=temperature, top_p=1.0, seed=1))
        assert [s(logits) for _ in range(20)] == [top] * 20


def test_the_seed_decides_the_draws():
    """Same seed, same 64 draws; another seed, other draws (uniform over 1000 tokens: two seeds
    agree on all 64 with probability 1e-192)."""
    logits = np.zeros(1000, np.float32)

    def draws(seed):
        s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
        return tuple(s(logits) for _ in range(64))
    assert draws(7) == draws(7)
    assert len({draws(seed) for seed in range(10)}) == 10


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_top_k_keeps_exactly_the_k_likeliest_at_their_relative_probabilities(top_k):
    order = np.argsort(-PROBS)
    kept, tail = order[:top_k], order[top_k:]
    f = _freqs(SamplingParams(temperature=1.0, top_k=top_k, seed=13))
    assert f[tail].sum() == 0 and (f[kept] > 0).all(), f
    want = np.zeros_like(PROBS)
    want[kept] = PROBS[kept] / PROBS[kept].sum()
    ok, z = _within(f, want)
    assert ok, f"top_k={top_k}: deviations in standard deviations {z.round(1)}"


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_off_keeps_every_token(off):
    ok, z = _within(_freqs(SamplingParams(temperature=1.0, top_k=off, seed=17)), PROBS)
    assert ok, z.round(1)


@pytest.mark.parametrize("temperature, min_p, kept", [(1.0, 0.25, 3), (1.0, 0.45, 2), (1.0, 0.1, 4),
                                                      (1.0, 0.2, 3), (2.0, 0.2, 5), (1.0, 1.0, 1)])
def test_min_p_keeps_the_tokens_near_the_likeliest_after_temperature(temperature, min_p, kept):
    """min_p 0.2 at T=1 keeps p >= 0.1 (0.5, 0.25, 0.15); at T=2 the flatter distribution
    (0.33 .. 0.08, the least 0.245 of the likeliest) keeps all five; min_p 1 only the likeliest."""
    flat = _softmax(LOGITS.astype(np.float64) / temperature)
    order = np.argsort(-flat)
    f = _freqs(SamplingParams(temperature=temperature, min_p=min_p, seed=19))
    assert f[order[kept:]].sum() == 0 and (f[order[:kept]] > 0).all(), f
    want = np.zeros_like(flat)
    want[order[:kept]] = flat[order[:kept]] / flat[order[:kept]].sum()
    ok, z = _within(f, want)
    assert ok, z.round(1)


def test_the_repetition_penalty_is_vllms_over_the_prompt_and_the_text():
    """A token of the prompt or of the text so far: a positive logit divided by the penalty, a
    negative one multiplied; others untouched. Greedy, so the choice shows the shaped logits."""
    rng = np.random.default_rng(2)
    logits = rng.uniform(-1.0, 1.0, 50).astype(np.float32)
    logits[[3, 7]] = [4.0, -1.0]                 # 3 in the prompt, positive; 7 negative
    logits[11] = 3.0                              # the next likeliest, never seen
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt=[3, 7])
    assert s(logits) == 11                        # 4 / 2 = 2 < 3
    shaped = s._shape(logits)
    assert shaped[3] == 2.0 and shaped[7] == -2.0 and shaped[11] == 1.5      # 11 chosen: now seen
    untouched = np.setdiff1d(np.arange(50), [3, 7, 11])
    assert np.array_equal(shaped[untouched], logits[untouched])
    plain = Sampler(SamplingParams(), prompt=[3, 7])
    assert plain(logits) == 3 and plain(logits) == 3   # 1: off


def test_min_tokens_holds_the_end_tokens_back():
    """The end tokens (the model's EOS given as `ends`, and stop_token_ids) cannot be drawn
    before min_tokens tokens, even when they are the likeliest; then they can. Where nothing
    else is allowed (a grammar's end), the end is drawn."""
    logits = np.zeros(10, np.float32)
    logits[[5, 7, 2]] = [9.0, 8.0, 1.0]             # 5 the EOS, 7 a stop token id, then 2
    s = Sampler(SamplingParams(min_tokens=3, stop_token_ids=[7]), ends=[5])
    assert [s(logits) for _ in range(4)] == [2, 2, 2, 5]
    hot = Sampler(SamplingParams(min_tokens=2, temperature=1.0, seed=1), ends=[5, 7])
    assert not {hot(logits) for _ in range(2)} & {5, 7}
    only_end = np.full(10, -np.inf, np.float32)
    only_end[5] = 0.0
    assert Sampler(SamplingParams(min_tokens=5), ends=[5])(only_end) == 5


@pytest.mark.parametrize("kw, needle", [({"temperature": -0.1}, "temperature"),
                                        ({"temperature": float("nan")}, "temperature"),
                                        ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
                                        ({"max_tokens": 0}, "max_tokens"), ({"top_k": -2}, "top_k"),
                                        ({"top_k": 2.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
                                        ({"min_p": float("nan")}, "min_p"),
                                        ({"repetition_penalty": 0}, "repetition_penalty"),
                                        ({"repetition_penalty": True}, "repetition_penalty"),
                                        ({"min_tokens": 65}, "min_tokens"),
                                        ({"min_tokens": -1}, "min_tokens"),
                                        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
                                        ({"stop_token_ids": 5}, "stop_token_ids"),
                                        ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                        ({"prompt_logprobs": True}, "prompt_logprobs"),
                                        ({"temperature": "0.5"}, "temperature"),
                                        ({"top_p": "1"}, "top_p"), ({"max_tokens": 8.0}, "max_tokens"),
                                        ({"seed": -1}, "seed"), ({"seed": "1"}, "seed")])
def test_out_of_range_parameters_are_refused(kw, needle):
    """Named as the caller names them: a field here (Python, HTTP), a flag on the command line."""
    with pytest.raises(ValueError, match=needle) as e:
        SamplingParams(**kw)
    assert "--" not in str(e.value)


def test_a_prompt_tokens_logprob_is_the_models_log_softmax_whatever_the_sampling():
    """prompt_logprobs: the prompt's next token and the top k under the model's distribution, as
    the row before it gives it: no penalty, bias or temperature of the request's sampling."""
    rng = np.random.default_rng(4)
    z = rng.normal(size=50).astype(np.float32)
    s = Sampler(SamplingParams(prompt_logprobs=3, temperature=1.7, presence_penalty=1.0,
                               logit_bias={"7": 50}, repetition_penalty=1.5), prompt=[7, 9])
    s.log_prompt(z, 9)
    (tok, lp, top, rank), = s.prompt_logprobs
    want = z.astype(np.float64) - np.log(np.exp(z.astype(np.float64)).sum())
    assert tok == 9 and lp == pytest.approx(want[9])
    assert rank == 1 + int((want > want[9]).sum())
    assert [t for t, _ in top] == list(np.argsort(-want)[:3])
    assert [v for _, v in top] == pytest.approx(list(np.sort(want)[::-1][:3]))
    assert s.logprobs == [] and s.drawn == 0          # nothing was drawn
