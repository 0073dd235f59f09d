"""The embedded worker through its real HTTP API, with the official ``openai`` client.

One worker (the bundled baseline, fp16, running on our ops) serves the whole module; references come
from transformers' own ``generate`` and forward pass on the same checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from squeezeserve.service.models.loader import read_config, resolve_dtype

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(baseline_worker: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{baseline_worker}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(baseline_dir: Path):
    """transformers' own model and tokenizer for the checkpoint the worker serves (stock modules), in the
    dtype the worker picks for it (``--dtype auto``)."""
    dtype = resolve_dtype("auto", read_config(baseline_dir), "cpu")
    tokenizer = AutoTokenizer.from_pretrained(baseline_dir)
    model = AutoModelForCausalLM.from_pretrained(baseline_dir, dtype=dtype).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def float32_pair(float32_baseline_worker: str, baseline_dir: Path):
    """A second worker serving the baseline in float32 (through the default decoder: our static one) and
    transformers' model in float32: greedy text is compared there, where bfloat16's near-ties (two logits
    within one bf16 rounding of each other, summed in a different order) cannot flip a token."""
    client = openai.OpenAI(
        base_url=f"{float32_baseline_worker}/v1", api_key="unused", max_retries=0, timeout=300
    )
    model = AutoModelForCausalLM.from_pretrained(baseline_dir, dtype=torch.float32).eval()
    return client, model, AutoTokenizer.from_pretrained(baseline_dir)


def _metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_chat_answers_the_capital_of_france(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


def test_greedy_completion_equals_transformers_generate(float32_pair) -> None:
    client, model, tokenizer = float32_pair
    for prompt in ["The history of the Roman empire", "def fibonacci(n):"]:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=24, do_sample=False)
        expected = tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == expected
        assert got.usage.completion_tokens == out.shape[1] - ids.input_ids.shape[1]


def test_greedy_chat_equals_transformers_generate(float32_pair) -> None:
    client, model, tokenizer = float32_pair
    messages = [{"role": "user", "content": "Name three colours."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    expected = tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert got.choices[0].message.content == expected


def test_streaming_completion_matches_non_streaming_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_sends_role_then_content_then_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in content
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens > 0
    # without include_usage there is no usage chunk
    plain = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


def test_echo_with_logprobs_scores_every_prompt_token_after_the_first(
    client: openai.OpenAI, reference, float32_pair
) -> None:
    model, tokenizer = reference
    prompt = "Perplexity over HTTP needs a logprob for every prompt token."
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = got.choices[0].logprobs
    ids = tokenizer(prompt).input_ids
    assert got.choices[0].text == prompt
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None

    def scores(m) -> torch.Tensor:
        with torch.inference_mode():
            logits = m(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)

    # The worker's bfloat16 forward is not transformers' (fused projections; on CPUs without native bf16
    # its dense projections run FBGEMM fp16 with fp32 activations), so both are held to float32: the
    # worker may be off by twice transformers' own bfloat16 error, plus 1e-3 for the log-softmax path.
    truth = scores(float32_pair[1])
    allowed = 2 * (scores(model) - truth).abs().max().item() + 1e-3
    assert (torch.tensor(lp.token_logprobs[1:]) - truth).abs().max().item() <= allowed
    assert "".join(lp.tokens) == prompt


def test_n_choices_with_a_seed_are_reproducible(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "prompt": "My favourite animal is",
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 3,
        "seed": 7,
    }
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # different seeds per choice
    assert first.usage.completion_tokens <= 3 * 12


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=[" 8"]
    )
    assert got.choices[0].finish_reason == "stop"
    assert " 8" not in got.choices[0].text and got.choices[0].text.startswith(" 6, 7,")


def test_concurrent_requests_all_complete_and_agree_with_sequential(client: openai.OpenAI) -> None:
    """Eight prompts of different lengths share the batch (left-padded KV cache, per-row positions)."""
    prompts = [f"Item {i}: " + "the quick brown fox " * i for i in range(8)]

    def run(prompt: str):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)

    sequential = [run(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(run, prompts))
    for seq, con in zip(sequential, concurrent, strict=True):
        assert con.choices[0].finish_reason == "length" and con.usage.completion_tokens == 12
        a, b = seq.choices[0].logprobs, con.choices[0].logprobs
        # Batched bf16 matmuls (8-bit mantissa) accumulate in another order than one-row ones: logprobs
        # move by up to ~0.2 nats (0.16 seen), and greedy paths may part after a near tie. Up to that
        # point each token's logprob must agree; a wrong mask or position is off by whole nats.
        for tok_a, tok_b, lp_a, lp_b in zip(
            a.tokens, b.tokens, a.token_logprobs, b.token_logprobs, strict=True
        ):
            assert abs(lp_a - lp_b) < 0.35
            if tok_a != tok_b:
                break


def test_unknown_model_is_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"


def test_bad_bodies_are_400_with_a_message(baseline_worker: str) -> None:
    url = f"{baseline_worker}/v1/completions"
    broken = httpx.post(url, content=b'{"model": ', headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    wrong = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": "many"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "max_tokens"
    too_long = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 10**6})
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
    no_messages = httpx.post(f"{baseline_worker}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"


def test_client_disconnect_stops_generation(baseline_worker: str) -> None:
    body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 4000, "stream": True}
    body["ignore_eos"] = True  # sampling may otherwise pick end-of-sequence first and finish at once
    before = _metric(baseline_worker, "squeezeserve_worker_generation_tokens_total")
    with httpx.stream("POST", f"{baseline_worker}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generation is under way; leaving the block hangs up
    deadline = time.monotonic() + 20
    while _metric(baseline_worker, "squeezeserve_worker_num_requests_running") > 0:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.1)
    # nothing finished normally, so the generated-token counter did not move by thousands
    assert _metric(baseline_worker, "squeezeserve_worker_generation_tokens_total") - before < 1000


def test_metrics_show_the_traffic(client: openai.OpenAI, baseline_worker: str) -> None:
    client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=3, temperature=0)
    text = httpx.get(f"{baseline_worker}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ok = [s for s in families["squeezeserve_worker_requests"].samples if s.labels.get("status") == "200"]
    assert sum(s.value for s in ok) >= 1
    ttft = [
        s
        for s in families["squeezeserve_worker_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert ttft[0].value >= 1
    assert not math.isnan(_metric(baseline_worker, "squeezeserve_worker_mean_batch_size"))


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_the_workers_own_errors_are_openai_shaped(baseline_worker: str) -> None:
    missing = httpx.get(f"{baseline_worker}/v1/nothing")
    wrong_method = httpx.get(f"{baseline_worker}/v1/completions")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert "detail" not in missing.json()


def test_docs_work_offline(baseline_worker: str) -> None:
    page = httpx.get(f"{baseline_worker}/docs")
    assert page.status_code == 200 and "https://" not in page.text
    assert httpx.get(f"{baseline_worker}/docs/assets/swagger-ui-bundle.js").status_code == 200


def test_sse_frames_are_well_formed(baseline_worker: str) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{baseline_worker}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in response.iter_lines() if line]
    assert frames[-1] == "data: [DONE]"
    for frame in frames[:-1]:
        assert json.loads(frame.removeprefix("data: "))["object"] == "text_completion"


def test_ignore_eos_generates_max_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30
    long = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30, extra_body={"ignore_eos": True}
    )
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 30
