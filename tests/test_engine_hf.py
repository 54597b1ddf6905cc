"""HFEngine on a random tiny Llama: batching, log-probs, seeds, stops, weight swaps; StubEngine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from tracerl.engines import Engine
from tracerl.engines.hf import HFEngine
from tracerl.engines.scoring import score_completion
from tracerl.engines.stub import StubEngine
from tracerl.types import Generation, SamplingParams

TEXTS = [
    "the cat sat on the mat",
    "1 + 2 = 3",
    "hello world, how are you?",
    "add 12 and 30: 42",
    "a tool call then an answer",
]
PROMPTS = [
    "the cat",
    "hello world, how are you? the cat sat on the mat",
    "1",
    "add 12 and 30:",
    "a tool call then",
    "the mat sat on the cat, hello",
    "1 + 2 = 3 and 12 + 30 = 42",
    "how are",
]


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<pad>", "<eos>", "<unk>"])
    tok.train_from_iterator(TEXTS * 5, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def _save_tiny_llama(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast) -> Path:
    return _save_tiny_llama(tmp_path_factory.mktemp("v0"), tokenizer, seed=0)


@pytest.fixture(scope="module")
def new_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast
) -> Path:
    return _save_tiny_llama(tmp_path_factory.mktemp("v1"), tokenizer, seed=1)


@pytest.fixture(scope="module")
def ref_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def new_ref_model(new_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(new_model_dir).eval()


@pytest.fixture
def engine(model_dir: Path) -> Iterator[HFEngine]:
    engine = HFEngine(model_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


def _hf_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """HF's own greedy decoding, up to and including an end token."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def runaway_prompt(ref_model: PreTrainedModel, prompt_ids: list[list[int]]) -> list[int]:
    """A prompt whose greedy completion runs 100 tokens without an end token."""
    eos = ref_model.config.eos_token_id
    for prompt in prompt_ids:
        if eos not in _hf_greedy(ref_model, prompt, 100):
            return prompt
    pytest.fail("every prompt reaches the end token greedily; pick other prompts")


async def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll until `condition()` is true (e.g. the engine has decoded some steps)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.001)


def _assert_logprobs_match(
    model: PreTrainedModel, prompt: list[int], gen: Generation, params: SamplingParams
) -> None:
    ref = score_completion(model, prompt, gen.completion_ids, params.temperature)
    assert len(gen.logprobs) == len(gen.completion_ids) == len(ref)
    assert max(abs(a - b) for a, b in zip(ref, gen.logprobs, strict=True)) <= 1e-4


MIXED = [
    SamplingParams(max_tokens=12, temperature=t, top_p=p, seed=i)
    for i, (t, p) in enumerate(
        [(0, 1), (0.5, 1), (0.7, 0.9), (1, 1), (1.2, 0.8), (0, 1), (1, 0.5), (0.9, 1)]
    )
]


def test_engines_satisfy_the_protocol(engine: HFEngine, tokenizer: PreTrainedTokenizerFast) -> None:
    assert isinstance(engine, Engine)
    assert isinstance(StubEngine(tokenizer=tokenizer), Engine)
    # The weight-sync seam is load_state_dict; a path loader is no part of the protocol.
    assert hasattr(Engine, "load_state_dict") and not hasattr(Engine, "load_weights")
    assert engine.tokenizer.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(AttributeError, match="without a tokenizer"):
        _ = StubEngine().tokenizer
    assert engine.eos_token_ids == [tokenizer.eos_token_id]
    assert engine.max_context == 128


def test_concurrent_requests_share_forward_passes(
    engine: HFEngine, ref_model: PreTrainedModel, prompt_ids: list[list[int]]
) -> None:
    async def main() -> list[Generation]:
        return await asyncio.gather(
            *[engine.generate(p, s) for p, s in zip(prompt_ids, MIXED, strict=True)]
        )

    gens = asyncio.run(main())
    assert engine.stats.batches < len(prompt_ids)
    assert engine.stats.peak_rows > 1
    assert engine.stats.requests == len(prompt_ids)
    for prompt, params, gen in zip(prompt_ids, MIXED, gens, strict=True):
        assert 1 <= len(gen.completion_ids) <= params.max_tokens
        assert gen.policy_version == 0
        _assert_logprobs_match(ref_model, prompt, gen, params)


def test_rows_joining_a_running_batch_keep_exact_logprobs(
    engine: HFEngine, ref_model: PreTrainedModel, prompt_ids: list[list[int]]
) -> None:
    long = [SamplingParams(max_tokens=40, temperature=1.0, seed=i) for i in range(4)]

    async def main() -> list[Generation]:
        first = [
            asyncio.ensure_future(engine.generate(p, s))
            for p, s in zip(prompt_ids[:4], long, strict=True)
        ]
        await _wait_for(lambda: engine.stats.decode_steps >= 3)
        late = [engine.generate(p, s) for p, s in zip(prompt_ids[4:], MIXED[4:], strict=True)]
        return await asyncio.gather(*first, *late)

    gens = asyncio.run(main())
    assert engine.stats.batches >= 2
    assert engine.stats.peak_rows > 4  # late rows decoded alongside early ones
    for prompt, params, gen in zip(prompt_ids, long + MIXED[4:], gens, strict=True):
        _assert_logprobs_match(ref_model, prompt, gen, params)


def test_requests_beyond_max_batch_size_wait_for_a_free_row(
    model_dir: Path, prompt_ids: list[list[int]]
) -> None:
    small = HFEngine(model_dir, max_batch_size=2)

    async def main() -> list[Generation]:
        params = SamplingParams(max_tokens=6, temperature=0)
        return await asyncio.gather(*[small.generate(p, params) for p in prompt_ids[:5]])

    try:
        gens = asyncio.run(main())
    finally:
        small.close()
    assert len(gens) == 5 and all(g.completion_ids for g in gens)
    assert small.stats.peak_rows == 2


def test_seeded_request_is_reproducible_in_any_batch(
    engine: HFEngine, prompt_ids: list[list[int]]
) -> None:
    mine = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    prompt = prompt_ids[3]

    async def main() -> list[list[int]]:
        alone = await engine.generate(prompt, mine)
        mates = [engine.generate(p, SamplingParams(max_tokens=16)) for p in prompt_ids[:3]]
        crowded = await asyncio.gather(*mates, engine.generate(prompt, mine))
        running = asyncio.ensure_future(
            engine.generate(prompt_ids[1], SamplingParams(max_tokens=30))
        )
        await _wait_for(lambda: engine.stats.running_rows > 0)
        joined = await engine.generate(prompt, mine)
        await running
        return [alone.completion_ids, crowded[-1].completion_ids, joined.completion_ids]

    alone, crowded, joined = asyncio.run(main())
    assert alone == crowded == joined


def test_greedy_matches_hf_generate(
    engine: HFEngine, ref_model: PreTrainedModel, prompt_ids: list[list[int]]
) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0)

    async def main() -> list[Generation]:
        return await asyncio.gather(*[engine.generate(p, greedy) for p in prompt_ids])

    for prompt, gen in zip(prompt_ids, asyncio.run(main()), strict=True):
        assert gen.completion_ids == _hf_greedy(ref_model, prompt, 16)


def test_max_tokens_and_max_context_end_with_length(
    engine: HFEngine, model_dir: Path, runaway_prompt: list[int]
) -> None:
    gen = asyncio.run(engine.generate(runaway_prompt, SamplingParams(max_tokens=5, temperature=0)))
    assert (len(gen.completion_ids), gen.finish_reason) == (5, "length")

    tight = HFEngine(model_dir, max_context=len(runaway_prompt) + 3)
    try:
        gen = asyncio.run(
            tight.generate(runaway_prompt, SamplingParams(max_tokens=50, temperature=0))
        )
    finally:
        tight.close()
    assert (len(gen.completion_ids), gen.finish_reason) == (3, "length")


def test_stop_string_ends_on_the_token_that_completes_it(
    engine: HFEngine, tokenizer: PreTrainedTokenizerFast, runaway_prompt: list[int]
) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0)
    full = asyncio.run(engine.generate(runaway_prompt, greedy)).completion_ids
    stop = tokenizer.decode(full[:6])[-3:]
    # Where the engine must stop: the first prefix whose text holds the stop string.
    expected = next(full[:n] for n in range(1, 31) if stop in tokenizer.decode(full[:n]))

    gen = asyncio.run(
        engine.generate(runaway_prompt, greedy.model_copy(update={"stop": ["#@!", stop]}))
    )
    assert gen.completion_ids == expected
    assert (gen.finish_reason, gen.stop_string) == ("stop", stop)


def test_bad_prompts_raise_value_error_at_once(engine: HFEngine) -> None:
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="max_context"):
        asyncio.run(engine.generate([5] * 128, params))
    with pytest.raises(ValueError, match="outside"):
        asyncio.run(engine.generate([5, 10_000], params))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(engine.generate([], params))
    assert engine.stats.requests == 0  # nothing reached the worker


def test_load_weights_switches_later_requests_only(
    engine: HFEngine,
    new_model_dir: Path,
    ref_model: PreTrainedModel,
    new_ref_model: PreTrainedModel,
    runaway_prompt: list[int],
) -> None:
    long = SamplingParams(max_tokens=100, temperature=0)
    short = SamplingParams(max_tokens=10, temperature=0.8, seed=3)

    async def main() -> tuple[Generation, Generation]:
        in_flight = asyncio.ensure_future(engine.generate(runaway_prompt, long))
        await _wait_for(lambda: engine.stats.decode_steps >= 2)
        assert not in_flight.done()
        engine.load_weights(str(new_model_dir), 1)
        assert engine.policy_version == 1
        later = await engine.generate(runaway_prompt, short)
        return await in_flight, later

    old, new = asyncio.run(main())
    assert old.policy_version == 0
    assert old.completion_ids == _hf_greedy(ref_model, runaway_prompt, 100)
    assert new.policy_version == 1
    _assert_logprobs_match(new_ref_model, runaway_prompt, new, short)
    assert engine.stats.weight_swaps == 1


def test_load_state_dict_serves_new_weights_without_disk(
    engine: HFEngine, new_ref_model: PreTrainedModel, prompt_ids: list[list[int]]
) -> None:
    engine.load_state_dict(new_ref_model.state_dict(), 7)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    gen = asyncio.run(engine.generate(prompt_ids[0], params))
    assert gen.policy_version == 7
    _assert_logprobs_match(new_ref_model, prompt_ids[0], gen, params)


def test_worker_errors_reach_the_caller_and_the_worker_survives(
    engine: HFEngine, prompt_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_forward(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.model, "forward", broken_forward)
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(engine.generate(prompt_ids[0], SamplingParams(max_tokens=4)))
    monkeypatch.undo()
    gen = asyncio.run(engine.generate(prompt_ids[0], SamplingParams(max_tokens=4)))
    assert len(gen.completion_ids) >= 1


def test_cancelled_request_leaves_the_batch(engine: HFEngine, runaway_prompt: list[int]) -> None:
    async def main() -> Generation:
        doomed = asyncio.ensure_future(
            engine.generate(runaway_prompt, SamplingParams(max_tokens=100, temperature=0))
        )
        await _wait_for(lambda: engine.stats.running_rows == 1)
        doomed.cancel()
        await _wait_for(lambda: engine.stats.running_rows == 0)
        return await engine.generate(runaway_prompt, SamplingParams(max_tokens=3, temperature=0))

    assert len(asyncio.run(main()).completion_ids) == 3
    assert engine.stats.decode_steps < 100


def test_closed_engine_refuses_requests(model_dir: Path) -> None:
    engine = HFEngine(model_dir)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(engine.generate([5], SamplingParams()))


def test_stub_engine_answers_fixed_ids() -> None:
    stub = StubEngine([7, 8, 9], policy_version=2)
    gen = asyncio.run(stub.generate([1, 2], SamplingParams()))
    assert gen.completion_ids == [7, 8, 9]
    assert gen.logprobs == [-0.5] * 3
    assert (gen.finish_reason, gen.policy_version) == ("stop", 2)
    short = asyncio.run(stub.generate([1], SamplingParams(max_tokens=2)))
    assert (short.completion_ids, short.finish_reason) == ([7, 8], "length")
    stub.load_state_dict({}, 3)
    assert asyncio.run(stub.generate([1], SamplingParams())).policy_version == 3
