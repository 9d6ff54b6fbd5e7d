"""AsyncLLM: concurrent asyncio streams batched by one engine loop, on the embedded SmolLM2."""

import asyncio
import contextlib

import pytest

from pagedkv import LLM, AsyncLLM, EngineStoppedError, PromptTooLongError, SamplingParams

OPTIONS = dict(dtype="float32", num_device_blocks=128, max_model_len=256)
PROMPTS = ["Hello", "The quick brown fox", "def fibonacci(n):", "Paris is the capital of"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def async_llm():
    llm = AsyncLLM(**OPTIONS)
    yield llm
    llm.shutdown()


async def wait_until_idle(llm: AsyncLLM) -> dict:
    for _ in range(200):
        stats = llm.stats()
        if stats["num_unfinished_requests"] == 0 and stats["num_free_device_blocks"] == stats["num_device_blocks"]:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"requests or blocks were not released: {llm.stats()}")


def test_concurrent_streams_equal_offline_generation(async_llm):
    reference = [out.outputs[0].token_ids for out in LLM(**OPTIONS).generate(PROMPTS, greedy(8), use_tqdm=False)]

    async def stream(prompt):
        outputs = [output async for output in async_llm.generate(prompt, greedy(8))]
        return outputs

    async def main():
        return await asyncio.gather(*(stream(prompt) for prompt in PROMPTS))

    streams = asyncio.run(main())
    assert [outputs[-1].outputs[0].token_ids for outputs in streams] == reference
    for outputs in streams:
        # One cumulative output per step, the last one finished.
        assert [len(output.outputs[0].token_ids) for output in outputs] == list(range(1, 9))
        assert [output.finished for output in outputs] == [False] * 7 + [True]
        texts = [output.outputs[0].text for output in outputs]
        assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))


def test_leaving_a_stream_early_or_aborting_frees_its_blocks(async_llm):
    async def main():
        async with contextlib.aclosing(async_llm.generate("Count to one hundred:", greedy(200))) as stream:
            async for output in stream:
                assert not output.finished
                break
        await wait_until_idle(async_llm)

        outputs = []

        async def consume():
            async for output in async_llm.generate("Count to one hundred:", greedy(200), request_id="to-abort"):
                outputs.append(output)
                if len(outputs) == 2:
                    async_llm.abort("to-abort")

        await asyncio.wait_for(consume(), 60)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert 2 <= len(outputs[-1].outputs[0].token_ids) < 200
        return await wait_until_idle(async_llm)

    stats = asyncio.run(main())
    assert stats["finished_by_reason"]["abort"] >= 2


def test_bad_requests_raise_on_the_first_iteration(async_llm):
    async def first(prompt, params=None, request_id=None):
        async for output in async_llm.generate(prompt, params, request_id):
            return output

    with pytest.raises(PromptTooLongError, match="max_model_len=256"):
        asyncio.run(first("word " * 400))
    with pytest.raises(ValueError, match="logit_bias"):
        asyncio.run(first("Hello", SamplingParams(logit_bias={10**9: 1.0})))
    assert asyncio.run(first("Hello", greedy(1))).finished  # the loop is still serving


def test_shutdown_ends_running_streams_with_an_error():
    llm = AsyncLLM(**OPTIONS)

    async def main():
        stream = llm.generate("Tell me a long story.", greedy(200))
        await stream.__anext__()
        llm.shutdown()
        with pytest.raises(EngineStoppedError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError, match="has stopped"):  # refused, not left waiting
            await llm.generate("Hello").__anext__()

    asyncio.run(main())


def test_a_crashed_loop_fails_its_callers_instead_of_hanging():
    llm = AsyncLLM(**OPTIONS)

    def broken_delivery(output):
        raise RuntimeError("bug")

    llm._loop._deliver = broken_delivery

    async def main():
        with pytest.raises(EngineStoppedError):
            async for _ in llm.generate("Hello", greedy(4)):
                pass
        assert not llm.is_running
        with pytest.raises(EngineStoppedError, match="has stopped"):
            await llm.generate("Hello").__anext__()

    asyncio.run(asyncio.wait_for(main(), 60))
    llm.shutdown()
