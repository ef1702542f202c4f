"""POST /v1/responses/compact through the openai client's `responses.compact` against a live uvicorn server: the model
is asked for a summary of the conversation, the answer holds the user messages and one compaction item, and a later
request sees the summary where the item sits."""

from __future__ import annotations

import openai
import pytest

from serve_app.openai_api.compaction import COMPACT_MAX_TOKENS, SUMMARY_REQUEST
from serve_app.openai_api.responses_input import COMPACTED_PREFACE
from serve_app.openai_api.stored_responses import MemoryResponseStore
from tests.serve_app.conftest import MODEL, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

SUMMARY = "The user plans a week in Rome; the hotel near Termini is booked; next: add two days in Naples."
SUMMARIZES = (f"<|channel|>analysis<|message|>Collect the plan.<|end|><|start|>assistant<|channel|>final<|message|>"
              f"{SUMMARY}<|return|>")
CONVERSATION = [
    {"role": "user", "content": "Plan a week in Rome."},
    {"role": "assistant", "content": "Booking the hotel first."},
    {"type": "function_call", "call_id": "c1", "name": "book_hotel", "arguments": '{"near": "Termini"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "booked: Hotel Roma, 7 nights"},
    {"role": "user", "content": [{"type": "input_text", "text": "Add two days in Naples."}]},
]


@pytest.fixture(scope="module")
def live():
    backend = ScriptedBackend()
    with scripted_app(backend, response_store=MemoryResponseStore(max_responses=50)) as server:
        yield backend, server


@pytest.fixture
def backend(live) -> ScriptedBackend:
    live[0].reset()
    return live[0]


@pytest.fixture
def api(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live[1].url}/v1", api_key="unused", max_retries=0, timeout=30)


def prompt_text(backend: ScriptedBackend, n: int = -1) -> str:
    return backend.encoding.decode(backend.requests[n].prompt_ids)


def test_compact_keeps_the_user_messages_and_the_models_summary(api, backend):
    backend.push(SUMMARIZES)
    compacted = api.responses.compact(model=MODEL, input=CONVERSATION, instructions="Be a travel agent.")
    assert compacted.object == "response.compaction" and compacted.usage.input_tokens > 0
    *users, item = compacted.output
    assert [(u.type, u.role, [c.text for c in u.content]) for u in users] == [
        ("message", "user", ["Plan a week in Rome."]), ("message", "user", ["Add two days in Naples."])]
    assert item.type == "compaction" and item.encrypted_content
    # the summarizing request: the whole conversation, then the request for a summary, at low effort
    asked = prompt_text(backend)
    for text in ("Be a travel agent.", "Booking the hotel first.", "booked: Hotel Roma", SUMMARY_REQUEST,
                 "Reasoning: low"):
        assert text in asked, text
    request = backend.requests[-1]  # at most COMPACT_MAX_TOKENS, and what the (stub's 8,192-token) context leaves
    assert request.sampling.max_tokens == min(COMPACT_MAX_TOKENS, backend.max_context - len(request.prompt_ids))

    # continued: the summary stands where the compaction item is, the compacted turns are gone
    backend.push("<|channel|>final<|message|>Naples added.<|return|>")
    nxt = api.responses.create(model=MODEL, input=[*(x.model_dump(exclude_none=True) for x in compacted.output),
                                                   {"role": "user", "content": "Go on."}])
    assert nxt.output_text == "Naples added."
    seen = prompt_text(backend)
    assert COMPACTED_PREFACE + SUMMARY in seen and "Plan a week in Rome." in seen and "Go on." in seen
    assert "Booking the hotel first." not in seen and "booked: Hotel Roma" not in seen
    assert seen.index("Add two days in Naples.") < seen.index(SUMMARY) < seen.index("Go on.")


def test_compact_a_stored_chain(api, backend):
    backend.push("<|channel|>final<|message|>Rome it is.<|return|>")
    first = api.responses.create(model=MODEL, input="Where should I go?")
    backend.push(SUMMARIZES)
    compacted = api.responses.compact(model=MODEL, previous_response_id=first.id, input="And for how long?")
    assert [u.content[0].text for u in compacted.output[:-1]] == ["Where should I go?", "And for how long?"]
    assert "Rome it is." in prompt_text(backend)


def test_refusals(api, backend):
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.create(model=MODEL, input=[{"type": "compaction", "encrypted_content": "someone-elses"},
                                                 {"role": "user", "content": "Hi"}])
    assert err.value.body["param"] == "input.0.encrypted_content"
    with pytest.raises(openai.NotFoundError):
        api.responses.compact(model="other", input="Hi")
    for empty in ({}, {"input": []}, {"input": ""}):
        with pytest.raises(openai.BadRequestError) as err:
            api.responses.compact(model=MODEL, **empty)
        assert err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.compact(model=MODEL, previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"
    backend.push("<|channel|>final<|message|><|return|>")  # no summary at all: a 503 to retry
    with pytest.raises(openai.InternalServerError) as err:
        api.responses.compact(model=MODEL, input="Hi")
    assert err.value.status_code == 503 and "no summary" in err.value.body["message"]
