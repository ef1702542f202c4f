"""The openai client's high-level helpers against the app (live uvicorn, scripted backend): `chat.completions.parse`
and `responses.parse` with a pydantic model, `pydantic_function_tool` calls, and the streaming helpers
(`chat.completions.stream`, `responses.stream`) whose event accumulators check every chunk and event they read
(an item, index or content part out of place raises in the client)."""

from __future__ import annotations

import openai
from pydantic import BaseModel

from tests.serve_app.conftest import MODEL

REASONED = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
ANSWER = REASONED + '{"city":"Paris","days":3}<|return|>'
CALL = ("<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}<|call|>')
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


class Weather(BaseModel):
    city: str
    days: int


WANT = Weather(city="Paris", days=3)


def test_parse_helpers_read_a_structured_answer(client, backend):
    backend.push(ANSWER)
    chat = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Weather)
    assert chat.choices[0].message.parsed == WANT and chat.choices[0].message.reasoning_content == "Think."
    sent = backend.requests[-1].sampling.constraint
    assert sent is not None and sent.final is not None  # the model's schema became the answer's grammar
    backend.push(ANSWER)
    assert client.responses.parse(model=MODEL, input="Weather in Paris for 3 days?", text_format=Weather
                                  ).output_parsed == WANT


def test_parse_helpers_read_a_pydantic_tool_call(client, backend):
    backend.push(CALL)
    chat = client.chat.completions.parse(model=MODEL, messages=USER,
                                         tools=[openai.pydantic_function_tool(Weather, name="get_weather")])
    [call] = chat.choices[0].message.tool_calls
    assert (call.function.name, call.function.parsed_arguments) == ("get_weather", WANT)
    assert chat.choices[0].finish_reason == "tool_calls"


def test_streaming_helpers_accumulate_what_the_plain_calls_return(client, backend):
    backend.push(ANSWER)
    with client.chat.completions.stream(model=MODEL, messages=USER, response_format=Weather) as stream:
        kinds = {event.type for event in stream}
        chat = stream.get_final_completion()
    assert {"content.delta", "content.done"} <= kinds and chat.choices[0].message.parsed == WANT
    backend.push(CALL)
    with client.chat.completions.stream(model=MODEL, messages=USER,
                                        tools=[openai.pydantic_function_tool(Weather, name="get_weather")]) as stream:
        kinds = {event.type for event in stream}
        called = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    assert called.choices[0].message.tool_calls[0].function.parsed_arguments == WANT
    backend.push(ANSWER)
    with client.responses.stream(model=MODEL, input="Weather in Paris for 3 days?", text_format=Weather) as stream:
        events = list(stream)
        response = stream.get_final_response()
    assert events[-1].type == "response.completed" and response.output_parsed == WANT
    assert [item.type for item in response.output] == ["reasoning", "message"]
    backend.push(CALL)
    tool = {"type": "function", "name": "get_weather", "strict": True,
            "parameters": {**Weather.model_json_schema(), "additionalProperties": False}}
    with client.responses.stream(model=MODEL, input="Weather in Paris for 3 days?", tools=[tool]) as stream:
        kinds = {event.type for event in stream}
        response = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    call = response.output[-1]
    assert (call.type, call.name, Weather.model_validate_json(call.arguments)) == ("function_call", "get_weather",
                                                                                     WANT)
