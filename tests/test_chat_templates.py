"""Chat records rendered by the models' own chat templates (data/chat.py, data/chat_templates/).

The text is checked against transformers' apply_chat_template given the same template, the loss mask against the
turns it must and must not cover, and tool-calling data trains through the CLI in a fresh process.
"""

import copy
import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import BACKEND, invoke, write_jsonl

from finetune.data import batching, chat, formats, templates
from finetune.model import presets
from finetune.platform.errors import UserError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "description": "How many days ahead"},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# Gemma 4, everything its template renders: a system turn, tools, thinking, two calls at once and their answers, a
# later user turn (before which the first answer's thinking is dropped) and a last answer with thinking.
TOOL_CHAT = {
    "tools": [WEATHER, TIME],
    "messages": [
        {"role": "system", "content": "You help with travel."},
        {"role": "user", "content": "Weather and time in Hanoi?"},
        {
            "role": "assistant",
            "reasoning_content": "Two tools, one call each.",
            "tool_calls": [
                {"id": "a", **call("get_weather", city="Hanoi", unit="celsius")},
                {"id": "b", **call("get_time", city="Hanoi")},
            ],  # fmt: skip
        },
        {"role": "tool", "tool_call_id": "a", "content": "31 degrees, humid"},
        {"role": "tool", "tool_call_id": "b", "content": "14:05"},
        {"role": "assistant", "content": "It is 31 degrees and humid, and 14:05."},
        {"role": "user", "content": "And in Oslo tomorrow?"},
        {
            "role": "assistant",
            "reasoning_content": "One call.",
            "tool_calls": [call("get_weather", city="Oslo", days=1)],
        },
        {"role": "tool", "name": "get_weather", "content": "4 degrees"},
        {"role": "assistant", "content": "4 degrees tomorrow in Oslo."},
    ],
}
# Gemma 3: a system turn (put before the first user turn), several turns, text the template trims.
PLAIN_CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 plus 2? "},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "\n6.\n"},
    ]
}
CASES = [("gemma-chat", "tiny", PLAIN_CHAT), ("gemma4-chat", "tiny-gemma4", PLAIN_CHAT),
         ("gemma4-chat", "tiny-gemma4", TOOL_CHAT)]  # fmt: skip


def read(obj):
    (record,), found = formats._records([("x.jsonl:1", copy.deepcopy(obj))], "x.jsonl")
    return record, found


def transformers_text(name, obj, **options):
    """The conversation as transformers' apply_chat_template renders it with the shipped template."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = models.WordLevel({"<unk>": 0, "<bos>": 1, "<eos>": 2}, unk_token="<unk>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(words), bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        chat_template=chat.source(templates.get(name).renderer.file),
    )  # fmt: skip
    return tokenizer.apply_chat_template(obj["messages"], tools=obj.get("tools"), tokenize=False, **options)


@pytest.mark.one_backend
@pytest.mark.parametrize("name, preset, obj", CASES)
def test_a_conversation_renders_as_transformers_renders_it_token_for_token(name, preset, obj):
    record, _ = read(obj)
    thinking = any(m.get("reasoning_content") for m in obj["messages"])
    expected = transformers_text(name, obj, **({"enable_thinking": True} if thinking else {}))
    pieces = templates.get(name).segments(record)
    ours = "".join(text for text, _ in pieces)
    # The same text, less <bos> (the tokenizer adds it) and the newline after the last turn (<eos> follows it).
    assert "<bos>" + ours + "\n" == expected
    tokenizer = presets.tiny_tokenizer(preset)
    assert batching._ids(tokenizer, ours) == batching._ids(tokenizer, expected.removeprefix("<bos>").removesuffix("\n"))
    # What training tokenizes (each piece on its own) is the whole text's ids.
    (example,), _ = batching.tokenize([pieces], tokenizer, seq_len=4096)
    assert example.token_ids == [batching.BOS, *batching._ids(tokenizer, ours), batching.EOS]


@pytest.mark.one_backend
def test_gemma4_renders_the_system_turn_tools_thinking_calls_and_answers():
    record, found = read(TOOL_CHAT)
    text = "".join(t for t, _ in templates.get("gemma4-chat").segments(record))
    assert found == "tool-chat"
    assert text.startswith("<|turn>system\n<|think|>\nYou help with travel.<|tool>declaration:get_weather{")
    assert '<|tool_call>call:get_weather{city:<|"|>Hanoi<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>' in text
    assert '<|tool_response>response:get_time{value:<|"|>14:05<|"|>}<tool_response|>' in text
    # The template drops an answer's thinking once a later user turn comes, and keeps the last one's.
    assert "Two tools" not in text and "<|channel>thought\nOne call.\n<channel|>" in text


# TOOL_CHAT in TRL's conversational prompt-completion form: the prompt holds the first exchange, calls and all, up
# to the second question; the completion is the answer to it, a call, the tool's answer and the reply.
TOOL_COMPLETION = {"tools": TOOL_CHAT["tools"], "prompt": TOOL_CHAT["messages"][:7],
                   "completion": TOOL_CHAT["messages"][7:]}  # fmt: skip


@pytest.mark.one_backend
def test_a_prompt_and_completion_with_tools_renders_as_the_chat_and_trains_the_completion_only():
    """TRL's prompt-completion form with tools reads as tool-chat; it renders as the same conversation given as
    `messages` does, and trains the completion's model turns (not the tool's answer), not the prompt's."""
    record, found = read(TOOL_COMPLETION)
    as_chat, _ = read(TOOL_CHAT)
    assert found == "tool-chat" and record.prompt_messages == 7 and record.tools == as_chat.tools
    whole = templates.get("gemma4-chat").segments(as_chat)
    trained, untrained, pieces = trained_and_not("gemma4-chat", record)
    assert "".join(t for t, _ in pieces) == "".join(t for t, _ in whole)
    for said in ('call:get_weather{city:<|"|>Oslo', "4 degrees tomorrow in Oslo.", "<|channel>thought\nOne call."):
        assert said in trained and said not in untrained
    for given in ("It is 31 degrees and humid, and 14:05.", "call:get_time{", "And in Oslo tomorrow?",
                  "4 degrees<|\"|>"):  # fmt: skip
        assert given in untrained and given not in trained
    # What the chat form trains after the prompt, the completion form trains too, and nothing before it.
    chat_trained = "".join(t for t, on in whole if on)
    assert chat_trained.endswith(trained) and len(trained) < len(chat_trained)


def sharegpt_of(obj: dict) -> dict:
    """TOOL_CHAT's first exchange in LLaMA-Factory's ShareGPT form (glaive_toolcall_en's): `function_call` turns of
    JSON {name, arguments} (a list for two at once), `observation` turns, bare function schemas as JSON text."""
    speakers = {"user": "human", "assistant": "gpt", "tool": "observation"}
    turns = []
    for m in obj["messages"][1:6]:
        if "tool_calls" in m:
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            turns.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
        else:
            turns.append({"from": speakers[m["role"]], "value": m["content"]})
    tools = json.dumps([t["function"] for t in obj["tools"]])
    return {"conversations": turns, "system": obj["messages"][0]["content"], "tools": tools}


@pytest.mark.one_backend
def test_llama_factory_s_sharegpt_tool_turns_read_as_the_same_tool_chat():
    """ShareGPT with function_call and observation turns and `tools` reads as tool-chat: the same text and trained
    spans as the conversation in TRL's form (without the thinking, which ShareGPT has no place for)."""
    as_trl = copy.deepcopy(TOOL_CHAT)
    as_trl["messages"] = [{k: v for k, v in m.items() if k not in ("reasoning_content", "id", "tool_call_id")}
                          for m in as_trl["messages"][:6]]  # fmt: skip
    for m in as_trl["messages"]:
        for c in m.get("tool_calls", []):
            c.pop("id", None)
    record, found = read(sharegpt_of(TOOL_CHAT))
    expected, _ = read(as_trl)
    assert found == "tool-chat" and record.tools == expected.tools
    ours, theirs = (templates.get("gemma4-chat").segments(r) for r in (record, expected))
    assert [on for _, on in ours] == [on for _, on in theirs]
    # The text alike, but for the tool message's name, which ShareGPT's observation has only from a single call.
    assert "".join(t for t, _ in ours).replace("response:get_weather", "response:") == "".join(
        t for t, _ in theirs).replace("response:get_weather", "response:")  # fmt: skip


@pytest.mark.parametrize(
    "turn, message",
    [({"from": "function_call", "value": "get_weather(Hanoi)"}, "message 2 is a function_call whose value is not a call"),
     ({"from": "function_call", "value": '{"arguments": {}}'}, "message 2 is a function_call whose value is not a call"),
     ({"from": "robot", "value": "x"}, "message 2 has from 'robot'; use system (first only), human, user, gpt"),
     ({"from": "observation", "value": "31"}, "message 2 is a tool's answer with no assistant tool_calls before it")],
)  # fmt: skip
def test_malformed_sharegpt_tool_turns_name_the_record_and_message(turn, message):
    obj = {"conversations": [{"from": "human", "value": "Hi?"}, turn, {"from": "gpt", "value": "Hi."}], "tools": "[]"}
    with pytest.raises(UserError, match=re.escape(f"x.jsonl:1: {message}")):
        read(obj)


def trained_and_not(name, record):
    pieces = templates.get(name).segments(record)
    return "".join(t for t, on in pieces if on), "".join(t for t, on in pieces if not on), pieces


@pytest.mark.one_backend
def test_the_model_s_turns_are_trained_and_the_rest_is_not():
    record, _ = read(TOOL_CHAT)
    trained, untrained, pieces = trained_and_not("gemma4-chat", record)
    for said in ("It is 31 degrees and humid, and 14:05.", "4 degrees tomorrow in Oslo.", "call:get_time{",
                 "call:get_weather{city:<|\"|>Oslo", "<|channel>thought\nOne call.\n<channel|>"):  # fmt: skip
        assert said in trained and said not in untrained
    for given in ("You help with travel.", "declaration:get_weather", "Weather and time in Hanoi?",
                  "And in Oslo tomorrow?", "31 degrees, humid", "response:get_time", "4 degrees<|\"|>"):  # fmt: skip
        assert given in untrained and given not in trained
    # The model writes the tool response's opening after its calls (generation stops there); the tool writes the rest.
    assert trained.count("<tool_call|><|tool_response>") == 2 and untrained.count("<tool_response|>") == 3
    # Every model turn ends trained on its <turn|> (axolotl #3754: the end of turn must be learned), no other turn.
    assert [t.endswith("<turn|>") for t, on in pieces if on] == [False, True, False, True]
    assert untrained.count("<turn|>") == 3  # the system turn's end and the two user turns' ends


@pytest.mark.one_backend
def test_gemma3_s_trained_spans_are_trl_s_assistant_mask():
    """TRL's Gemma 3 training template marks the assistant's text with {% generation %}; transformers renders it
    and returns those spans. Ours are the same, less the newline after each <end_of_turn>, which TRL also marks
    and finetune leaves to the template (generation stops at <end_of_turn>)."""
    from pathlib import Path

    import trl
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (Path(trl.__file__).parent / "chat_templates" / "gemma3_training.jinja").read_text(encoding="utf-8")
    (text,), (spans,) = render_jinja_template(
        [PLAIN_CHAT["messages"]], chat_template=source, return_assistant_tokens_mask=True, bos_token="<bos>"
    )
    trl_spans = [text[start:end].removesuffix("\n") for start, end in spans]
    record, _ = read(PLAIN_CHAT)
    pieces = templates.get("gemma-chat").segments(record)
    assert [piece for piece, trained in pieces if trained] == trl_spans == ["4.<end_of_turn>", "6.<end_of_turn>"]
    assert "<bos>" + "".join(piece for piece, _ in pieces) + "\n" == text


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "name, preset, end", [("gemma-chat", "tiny", "<end_of_turn>"), ("gemma4-chat", "tiny-gemma4", "<turn|>")]
)
def test_the_turn_end_token_carries_the_loss_after_the_model_s_turns_only(name, preset, end):
    """Token for token: the end-of-turn id weighs 1 where it closes the model's turn, 0 where it closes another."""
    record, _ = read(PLAIN_CHAT)
    tokenizer = presets.tiny_tokenizer(preset)
    (example,), _ = batching.tokenize([templates.get(name).segments(record)], tokenizer, seq_len=512)
    end_id = tokenizer.token_to_id(end)
    weights = [w for i, w in zip(example.token_ids, example.weights) if i == end_id]
    system_turn = name == "gemma4-chat"  # Gemma 4's system turn is its own; Gemma 3's goes before the first user turn
    assert weights == [0.0] * system_turn + [0.0, 1.0, 0.0, 1.0]
    assert example.token_ids[-2:] == [end_id, batching.EOS] and example.weights[-2:] == [1.0, 1.0]


@pytest.mark.one_backend
def test_gemma3_has_no_tool_turns_and_says_so():
    record, found = read(TOOL_CHAT)
    with pytest.raises(UserError, match="gemma-chat template does not render.*Gemma 4"):
        templates.for_data("auto", found, "gemma-chat", "tiny-gemma3", "x.jsonl")
    assert templates.for_data("auto", found, "gemma4-chat", "tiny-gemma4", "x.jsonl")[0] == "gemma4-chat"
    # transformers refuses the same conversation with Gemma 3's template: its roles must alternate.
    with pytest.raises(Exception, match="alternate"):
        transformers_text("gemma-chat", TOOL_CHAT)


@pytest.mark.one_backend
def test_each_tool_answer_is_tied_to_its_call_by_id_name_or_order():
    """Gemma 4's template writes an answer under the name of the call whose id its tool_call_id gives: without ids,
    both answers of a message of two calls were written under the last call's name. Calls without ids get theirs,
    and each answer the id of its call: by tool_call_id, else by name, else in order."""
    obj = copy.deepcopy(TOOL_CHAT)
    for message in obj["messages"]:
        message.pop("tool_call_id", None)
        for call in message.get("tool_calls", ()):
            call.pop("id", None)
    obj["messages"][3]["name"], obj["messages"][4]["name"] = "get_time", "get_weather"  # answers out of order
    record = read(obj)[0]
    calls = {call["function"]["name"]: call["id"] for call in record.messages[2]["tool_calls"]}
    assert record.messages[3]["tool_call_id"] == calls["get_time"]
    assert record.messages[4]["tool_call_id"] == calls["get_weather"]
    assert record.messages[8]["tool_call_id"] == record.messages[7]["tool_calls"][0]["id"]
    text = templates.get("gemma4-chat").segments(record)
    rendered = "".join(piece for piece, _ in text)
    assert rendered.index("response:get_time") < rendered.index("response:get_weather"), rendered


def test_calls_of_any_tool_are_read_where_the_record_declares_none():
    """Without `tools` a record declares nothing to check a call's name against (some datasets keep no schemas)."""
    obj = copy.deepcopy(TOOL_CHAT)
    del obj["tools"]
    obj["messages"][7]["tool_calls"][0]["function"]["name"] = "get_wether"
    obj["messages"][8]["name"] = "get_wether"
    assert read(obj)[0].messages[7]["tool_calls"][0]["function"]["name"] == "get_wether"


def test_tool_call_arguments_written_as_json_text_are_read_as_objects():
    obj = copy.deepcopy(TOOL_CHAT)
    obj["messages"][7]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Oslo", "days": 1})
    obj["tools"] = json.dumps(obj["tools"])  # as Hugging Face datasets often store them
    assert read(obj)[0] == read(TOOL_CHAT)[0]


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m[2]["tool_calls"][0].pop("function"), "message 3's tool_calls\\[0\\] is not a call"),
        (
            lambda m: m[7]["tool_calls"][0]["function"].update(arguments="{city"),
            "message 8's tool_calls\\[0\\] has arguments written as text that is not JSON \\(Expecting",
        ),
        (lambda m: m[2].update(tool_calls=[]), "message 3's tool_calls must be a list"),
        (lambda m: m.pop(2), "message 3 is a tool's answer with no assistant tool_calls before it"),
        (lambda m: m[1].update(role="robot"), "message 2 has role 'robot'"),
        (lambda m: m.pop(), "the last message must be the assistant's"),
        (
            lambda m: m[7]["tool_calls"][0]["function"].update(name="get_wether"),
            "message 8 calls 'get_wether', which the record's tools do not declare \\(get_weather, get_time\\)",
        ),
        (lambda m: m.pop(8), "message 9 is the assistant's, but the assistant's tool_calls before it have no answer"),
        (lambda m: m.insert(3, {"role": "user", "content": "Well?"}), "message 4 is the user's, but the assistant's"),
        (lambda m: m.pop(4), "the tool calls before message 5 left 'get_time' without a `tool` answer"),
        (lambda m: m[8].update(name="get_time"), "message 9 is 'get_time''s answer, but no unanswered call"),
        (lambda m: m[3].update(tool_call_id="z"), "message 4 answers call 'z', which no unanswered call"),
        (lambda m: m.insert(5, {"role": "tool", "content": "more"}), "message 6 is a tool's answer, but every call"),
    ],
)
def test_malformed_tool_chats_name_the_record_and_message(change, message):
    obj = copy.deepcopy(TOOL_CHAT)
    change(obj["messages"])
    with pytest.raises(UserError, match=f"x.jsonl:1: {message}"):
        read(obj)


def tool_records(n=12):
    """Short tool-calling chats (the tiny tokenizers spell the tool markers out): a call, its answer, the reply."""
    cities = ["Paris", "Hanoi", "Lima", "Oslo", "Cairo", "Quito"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"{cities[i % 6]}?"},
                {"role": "assistant", "tool_calls": [call("w", c=cities[i % 6])]},
                {"role": "tool", "name": "w", "content": f"{i} C"},
                {"role": "assistant", "content": f"{i} C."},
            ]
        }
        for i in range(n)
    ]


def finetune(*args, timeout=600):
    """The CLI in a fresh process, on this suite's backend."""
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    command = [sys.executable, "-m", "finetune", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def test_tool_calling_data_trains_tiny_gemma4_through_the_cli_by_the_recipe(tmp_path):
    """The gemma4-2b-tools recipe, shrunk to tiny-gemma4, trains on tool-calling chats in a fresh process."""
    data = write_jsonl(tmp_path / "tools.jsonl", tool_records())
    out = tmp_path / "run"
    done = finetune("gemma", "--recipe", "gemma4-2b-tools", "--preset", "tiny-gemma4", "--backend", BACKEND,
                    "--data", data, "--seq-len", "128",
                    "--batch-size", "2", "--max-steps", "2", "--precision", "float32", "--set", "train.samples=0",
                    "--output", out)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tool-chat format" in done.stdout and "gemma4-chat" in done.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [v for k, v in metrics.items() if "loss" in k and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), metrics
    # Prompted as it trained: the tools declared, a system prompt before the question.
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER["function"], TIME]), encoding="utf-8")  # bare and OpenAI's forms
    answered = finetune("generate", "--run", out, "--system", "Answer briefly.", "--tools", tools, "--prompt", "Paris?",
                        "--max-new-tokens", "3", "--think")  # fmt: skip
    assert answered.returncode == 0 and answered.stdout.strip(), answered.stderr[-3000:]


@pytest.mark.one_backend  # the text the template renders: Python's
@pytest.mark.parametrize("name", ["gemma-chat", "gemma4-chat"])
def test_generate_s_system_prompt_and_tools_render_as_a_record_of_them_trains(name, tmp_path):
    """`finetune generate --system --tools` prompts the model with the text training put before the model's turn
    of a chat record with that system message and those tools (Gemma 3's folds the system into the user turn)."""
    from finetune.training import runs

    template = templates.get(name)
    tools = [WEATHER, TIME] if template.tools else None
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "Sunny."}]  # fmt: skip
    record = {"messages": messages, **({"tools": tools} if tools else {})}
    records, _ = formats.read(str(write_jsonl(tmp_path / "one.jsonl", [record])))
    given = runs.Given(system="Answer briefly.", tools=tools)
    asked = template.apply(runs._framing(given, template, raw=False)("Paris?"))[0]
    assert asked == template.apply(records[0])[0]
    assert "Answer briefly." in asked and ("get_time" in asked) == bool(tools), asked


@pytest.mark.one_backend  # the text the template renders: Python's
def test_generate_s_think_renders_the_prompt_of_a_record_with_thinking(tmp_path):
    """`finetune generate --think` prompts a run trained on records with thinking as they trained (Gemma 4's
    <|think|> in the system turn, with or without a system prompt); it had no way to, so such a run was asked
    without the switch. A template without one refuses it, as does --raw."""
    from finetune.training import runs

    template = templates.get("gemma4-chat")
    for system in ((), ({"role": "system", "content": "Answer briefly."},)):
        messages = [*system, {"role": "user", "content": "Paris?"},
                    {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}]  # fmt: skip
        records, _ = formats.read(str(write_jsonl(tmp_path / "think.jsonl", [{"messages": messages}])))
        given = runs.Given(system=system[0]["content"] if system else None, think=True)
        asked = template.apply(runs._framing(given, template, raw=False)("Paris?"))[0]
        assert asked == template.apply(records[0])[0] and "<|think|>" in asked, asked
    assert "<|think|>" not in template.apply(runs._framing(runs.Given(), template, raw=False)("Paris?"))[0]
    with pytest.raises(UserError, match="gemma-chat, which has none"):
        runs._framing(runs.Given(think=True), templates.get("gemma-chat"), raw=False)
    with pytest.raises(UserError, match="--raw sends the prompt as is; put the thinking switch"):
        runs._framing(runs.Given(think=True), template, raw=True)


def prompt_completion(record: dict) -> dict:
    """A tool_records() chat in TRL's prompt-completion form."""
    return {"prompt": record["messages"][:1], "completion": record["messages"][1:]}


def llama_factory(record: dict) -> dict:
    """A tool_records() chat in LLaMA-Factory's ShareGPT form."""
    user, called, answer, reply = record["messages"]
    call = called["tool_calls"][0]["function"]
    return {"conversations": [{"from": "human", "value": user["content"]},
                              {"from": "function_call", "value": json.dumps(call)},
                              {"from": "observation", "value": answer["content"]},
                              {"from": "gpt", "value": reply["content"]}]}  # fmt: skip


@pytest.mark.backend_neutral  # the forms are read in Python; tool-chat trains on every backend (the test above)
@pytest.mark.parametrize("form", [prompt_completion, llama_factory])
def test_other_forms_of_tool_calls_train_tiny_gemma4_and_tiny_gemma3_refuses_them(form, tmp_path):
    """TRL's prompt-completion form and LLaMA-Factory's ShareGPT form of tool-calling chats train tiny-gemma4 in a
    fresh process; tiny-gemma3, whose template has no tool turns, refuses them with exit 2, nothing written."""
    data = write_jsonl(tmp_path / "tools.jsonl", [form(r) for r in tool_records()])
    done = finetune("gemma", "--preset", "tiny-gemma4", "--backend", BACKEND, "--data", data, "--seq-len", "128",
                    "--batch-size", "2", "--max-steps", "2", "--precision", "float32", "--set", "train.samples=0",
                    "--output", tmp_path / "run")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tool-chat format" in done.stdout and "gemma4-chat" in done.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 2
    refused = finetune("gemma", "--preset", "tiny-gemma3", "--backend", BACKEND, "--data", data, "--max-steps", "2",
                       "--output", tmp_path / "refused")  # fmt: skip
    assert refused.returncode == 2 and "Gemma 3's chat template has no tool turns" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "refused").exists()


@pytest.mark.backend_neutral
def test_tool_calling_data_on_tiny_gemma3_is_refused_before_anything_is_written(tmp_path):
    data = write_jsonl(tmp_path / "tools.jsonl", tool_records())
    out = tmp_path / "run"
    done = finetune("gemma", "--preset", "tiny-gemma3", "--data", data, "--seq-len", "128", "--max-steps", "2",
                    "--output", out)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Gemma 3's chat template has no tool turns" in done.stderr and not out.exists()


@pytest.mark.backend_neutral
def test_a_malformed_tool_call_is_refused_with_its_record_named(tmp_path):
    records = tool_records()
    records[1]["messages"][1]["tool_calls"] = [{"type": "function", "function": {"arguments": {"c": "x"}}}]
    data = write_jsonl(tmp_path / "tools.jsonl", records)
    out = tmp_path / "run"
    done = finetune("gemma", "--preset", "tiny-gemma4", "--data", data, "--max-steps", "2", "--output", out)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{data}:2: message 2's tool_calls[0] is not a call" in done.stderr and not out.exists()


@pytest.mark.one_backend
def test_finetune_data_shows_the_rendered_tool_chat_with_the_model_s_parts_marked(tmp_path):
    data = write_jsonl(tmp_path / "tools.jsonl", tool_records())
    result = invoke("data", data, "--preset", "tiny-gemma4", "--seq-len", "128")
    assert result.exit_code == 0, result.output
    assert "tool-chat" in result.output and "template: gemma4-chat" in result.output
    assert '«<|tool_call>call:w{c:<|"|>Paris<|"|>}<tool_call|><|tool_response>»response:w{' in result.output
    assert "«0 C.<turn|><eos>»" in result.output
