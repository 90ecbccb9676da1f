"""Engine robustness (issue 11): a bad request or a failing step never poisons the engine, and ``auto`` runs the
checkpoint's own KV-cache dtype."""

import pytest
import torch
from test_engine import GREEDY, engine, prompts, tiny_model

from compress.engine import LLM, SamplingParams

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


def assert_idle_and_clean(llm: LLM) -> None:
    """Nothing queued or running, and every KV block back in the pool."""
    assert not llm.has_unfinished()
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("bad_id", [256, 60000, -3])
def test_out_of_range_token_id_is_rejected_and_later_calls_work(bad_id):
    model = tiny_model()
    llm = engine(model)
    good = prompts([7, 11])
    with pytest.raises(ValueError, match=rf"token id {bad_id} .*vocabulary of 256"):
        llm.generate([good[0], [1, 2, bad_id, 4]], SHORT)
    assert_idle_and_clean(llm)
    with pytest.raises(ValueError, match=rf"token id {bad_id}"):
        llm.add_request([bad_id], SHORT)
    assert_idle_and_clean(llm)
    expected = engine(model).generate(good, SHORT)
    assert [o.token_ids for o in llm.generate(good, SHORT)] == [o.token_ids for o in expected]


@pytest.mark.parametrize(("bad_prompt", "message"), [([1] * 250, "max_model_len"), ([], "empty prompt")])
def test_one_bad_prompt_queues_nothing_of_its_batch(bad_prompt, message):
    model = tiny_model()
    llm = engine(model)
    good = prompts([9, 5])
    with pytest.raises(ValueError, match=message) as error:
        llm.generate([good[0], bad_prompt, good[1]], GREEDY)
    assert_idle_and_clean(llm)
    assert str(error.value).startswith("prompt 1: ")  # which prompt of the batch is bad
    # The next call runs exactly its own prompt: nothing of the failed batch ran silently in it.
    outputs = llm.generate([good[1]], GREEDY)
    assert len(llm.requests) == 0 and len(outputs) == 1
    assert outputs[0].token_ids == engine(model).generate([good[1]], GREEDY)[0].token_ids


def corrupt_token_model(bad_token: int):
    """A model whose embedding row ``bad_token`` is NaN, as in a damaged checkpoint: a prompt holding that token
    gives NaN logits, which sampling with a temperature rejects in the middle of a step."""
    model = tiny_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[bad_token] = float("nan")
    return model


def test_a_step_that_raises_finishes_its_requests_with_an_error_and_later_calls_start_clean():
    model = corrupt_token_model(bad_token=5)
    llm = engine(model)
    clean = prompts([12, 6], seed=2)
    assert 5 not in clean[0] + clean[1]
    sampled = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=0)
    first = llm.add_request([3, 5, 8], sampled)
    with pytest.raises(RuntimeError):
        llm.generate(clean, GREEDY)
    assert llm.output(first).finish_reason == "error"
    assert_idle_and_clean(llm)
    expected = [o.token_ids for o in engine(model).generate(clean, GREEDY)]
    assert [o.token_ids for o in llm.generate(clean, GREEDY)] == expected


def test_a_stream_closed_early_leaves_nothing_behind():
    model = tiny_model()
    llm = engine(model)
    stream = llm.stream(prompts([8, 15]), GREEDY)
    next(stream)
    stream.close()
    assert_idle_and_clean(llm)
    assert [o.finish_reason for o in llm.generate(prompts([4]), SHORT)] == ["length"]
