"""Chat prompts: the model's chat template renders and tokenizes exactly as transformers'
`apply_chat_template(..., add_generation_prompt=True)` does, a chat request over gRPC decodes the
same tokens as its rendered ids, and every bad chat is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from engine.v1 import engine_pb2 as pb
from engine_service.model.chat_template import ChatMessage, ChatTemplate, ChatTemplateError, load_chat_template
from engine_service.model.loader import LoadedModel, load_model
from shared.errors import DOMAIN
from tests.checkpoints import make_checkpoint
from tests.contract import decode, expect_error, tokens_of
from tests.engines import EngineProcess

# ChatML-style, on the checkpoint's own special tokens: a default system prompt when the chat has
# none, and roles that must alternate user/assistant after an optional leading system message.
TEMPLATE = """\
{% if messages[0]['role'] != 'system' %}
{{ bos_token }}system
You are a helpful assistant.{{ eos_token }}
{% endif %}
{% for message in messages %}
{% if message['role'] == 'system' and not loop.first %}
{{ raise_exception('a system message may only come first, got one at index ' ~ loop.index0) }}
{% endif %}
{% if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{{ bos_token + message['role'] + '\\n' + message['content'] | trim + eos_token + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
{{ bos_token }}assistant
{% endif %}
"""
# Exercises the rest of the environment: tojson (no HTML escaping, options), namespace,
# loop controls, dict, the other special tokens, and a {% generation %} block.
KITCHEN_SINK = """\
{% set ns = namespace(count=0) %}
{% for message in messages %}
{% if message['content'] == 'skip' %}{% continue %}{% endif %}
{% set ns.count = ns.count + 1 %}
{{ dict(role=message['role'], n=ns.count) | tojson(sort_keys=True) }} {{ message['content'] | tojson }}
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}
{% if message['content'] == 'stop' %}{% break %}{% endif %}
{% endfor %}
{{ pad_token }}{{ tools is none }}{{ documents is none }}{% if add_generation_prompt %}<gen>{% endif %}
"""
CHATS = [
    [{"role": "user", "content": "the quick brown fox"}],
    [{"role": "system", "content": "rotary embeddings"}, {"role": "user", "content": "  jumps over  "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "lazy dog"},
     {"role": "user", "content": "naïve café, déjà vu — 東京 🙂 <s> </s> & <tag>"}],
    [{"role": "user", "content": ""}],
]
OUT_OF_ORDER = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
CPU = torch.device("cpu")


def write_chat_checkpoint(root: Path, template: object = TEMPLATE) -> Path:
    directory = make_checkpoint(root, "llama", tied=False)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": {"__type": "AddedToken", "content": "<pad>", "special": True}, "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def messages_of(chat: list[dict[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(**m) for m in chat]


def chat_prompt(chat: list[dict[str, str]]) -> pb.ChatPrompt:
    return pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in chat])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> LoadedModel:
    return load_model(str(checkpoint), CPU, torch.float32)


@pytest.fixture(scope="module")
def chat_engine(checkpoint: Path):  # type: ignore[no-untyped-def]
    with EngineProcess("--model", str(checkpoint), "--max-batch", "4", "--max-context", "256",
                       "--max-new-tokens", "64") as proc:
        yield proc


def reference_ids(reference: transformers.PreTrainedTokenizerBase, chat: list[dict[str, str]]) -> list[int]:
    return reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


# -- rendering and tokenizing, against transformers ----------------------------------------------
@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_render_and_tokens_equal_transformers(loaded: LoadedModel, reference, chat) -> None:  # type: ignore[no-untyped-def]
    template = loaded.chat_template
    assert template is not None
    text = template.render(messages_of(chat))
    assert text == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == reference_ids(reference, chat)


def test_the_loader_reads_the_special_tokens_of_tokenizer_config(loaded: LoadedModel, reference) -> None:  # type: ignore[no-untyped-def]
    template = loaded.chat_template
    assert template is not None
    named = {"bos_token": template.bos_token, "eos_token": template.eos_token, **template.special_tokens}
    assert named == reference.special_tokens_map


def test_the_rest_of_the_environment_equals_transformers(reference) -> None:  # type: ignore[no-untyped-def]
    template = ChatTemplate(KITCHEN_SINK, bos_token="<s>", eos_token="</s>", special_tokens={"pad_token": "<pad>"})
    chat = [{"role": "user", "content": "<b>'quotes' & \"more\" é"}, {"role": "assistant", "content": "skip"},
            {"role": "assistant", "content": "fine"}, {"role": "user", "content": "stop"},
            {"role": "user", "content": "never rendered"}]
    expected = reference.apply_chat_template(chat, chat_template=KITCHEN_SINK, add_generation_prompt=True,
                                             tokenize=False)
    assert template.render(messages_of(chat)) == expected
    assert "<b>'quotes'" in expected and "é" in expected  # tojson escapes neither HTML nor non-ASCII


def test_a_template_that_raises_is_a_chat_template_error_with_its_message(loaded: LoadedModel, reference) -> None:  # type: ignore[no-untyped-def]
    template = loaded.chat_template
    assert template is not None
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(messages_of(OUT_OF_ORDER))
    with pytest.raises(Exception, match="roles must alternate"):  # transformers refuses it too
        reference.apply_chat_template(OUT_OF_ORDER, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize(("source", "fragment"), [
    ("{{ 1 + messages[0]['content'] }}", "TypeError"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ messages.clear() }}", "unsafe"),  # the sandbox refuses a mutation
    ("{{ ''.__class__ }}{{ x.y.z }}", "undefined"),
])
def test_errors_inside_a_template_are_chat_template_errors(source: str, fragment: str) -> None:
    with pytest.raises(ChatTemplateError, match=fragment):
        ChatTemplate(source).render([ChatMessage("user", "hi")])


def test_a_syntax_error_names_the_template_source(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="my template.*line 1"):
        ChatTemplate("{% for message in messages %}", origin="my template")
    directory = write_chat_checkpoint(tmp_path, "{% if %}")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_model(str(directory), CPU, torch.float32)


def test_where_the_template_comes_from(tmp_path: Path) -> None:
    directory = write_chat_checkpoint(tmp_path, [{"name": "tool_use", "template": "tools"},
                                                 {"name": "default", "template": "default"}])
    template = load_chat_template(directory)
    assert template is not None and template.source == "default"
    (directory / "chat_template.jinja").write_text("from the jinja file")
    template = load_chat_template(directory)
    assert template is not None and template.source == "from the jinja file"
    assert transformers.AutoTokenizer.from_pretrained(directory).chat_template == "from the jinja file"
    (directory / "chat_template.jinja").unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert load_chat_template(directory) is None
    assert load_model(str(directory), CPU, torch.float32).chat_template is None


def test_a_bad_template_stops_the_engine_before_serving(tmp_path: Path, start_engine) -> None:  # type: ignore[no-untyped-def]
    directory = write_chat_checkpoint(tmp_path, "{{ unclosed")
    proc = start_engine("--model", str(directory), wait_serving=False)
    assert proc.wait(timeout=60) == 2
    [failed] = proc.wait_events("engine_start_failed")
    assert "chat_template" in failed["error"] and "tokenizer_config.json" in failed["error"]


# -- over gRPC ------------------------------------------------------------------------------------
def test_server_info_says_whether_the_model_has_a_chat_template(chat_engine, engine) -> None:  # type: ignore[no-untyped-def]
    assert chat_engine.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5).has_chat_template
    assert not engine.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5).has_chat_template


def test_a_chat_decodes_as_its_rendered_tokens(chat_engine, reference) -> None:  # type: ignore[no-untyped-def]
    chat = CHATS[2]
    ids = reference_ids(reference, chat)
    as_chat = decode(chat_engine.stub(), chat=chat_prompt(chat), max_new_tokens=12, ignore_eos=True)
    as_ids = decode(chat_engine.stub(), prompt_token_ids=pb.TokenIds(ids=ids), max_new_tokens=12, ignore_eos=True)
    assert as_chat[-1].usage.prompt_tokens == len(ids)
    assert len(as_chat) > 1 and len(tokens_of(as_chat)) == 12, "the tokens stream in several messages"
    assert tokens_of(as_chat) == tokens_of(as_ids)
    assert "".join(r.text for r in as_chat) == "".join(r.text for r in as_ids)


def _expect_invalid_field(proc: EngineProcess, field: str, **fields: object) -> dict:
    before = proc.load().requests_finished
    got = expect_error(decode, proc.stub(), max_new_tokens=4, **fields)
    assert got["code"] == grpc.StatusCode.INVALID_ARGUMENT, got["message"]
    assert got["info"].reason == "INVALID_FIELD" and got["info"].domain == DOMAIN
    assert got["info"].metadata["field"] == field
    violation = got["bad_request"].field_violations[0]
    assert violation.field == field and violation.description == got["message"]
    assert got["message"].startswith(field)
    assert proc.load().requests_finished == before, "a rejected request must never be queued"
    return got


def test_chat_to_a_model_without_a_template_is_invalid_field(engine) -> None:  # type: ignore[no-untyped-def]
    got = _expect_invalid_field(engine, "chat", chat=chat_prompt(CHATS[0]))
    assert "no" in got["message"] and "chat template" in got["message"] and "prompt_text" in got["message"]


def test_empty_messages_are_invalid_field(chat_engine) -> None:  # type: ignore[no-untyped-def]
    got = _expect_invalid_field(chat_engine, "chat.messages", chat=pb.ChatPrompt())
    assert got["message"] == "chat.messages must hold at least one message, got []"


def test_more_messages_than_the_context_is_refused_before_rendering(chat_engine) -> None:  # type: ignore[no-untyped-def]
    chat = [{"role": ("user", "assistant")[i % 2], "content": ""} for i in range(257)]
    got = _expect_invalid_field(chat_engine, "chat.messages", chat=chat_prompt(chat))
    assert got["message"] == "chat.messages must hold at most max_context_tokens 256 messages, got 257"


def test_an_empty_role_is_invalid_field_naming_its_index(chat_engine) -> None:  # type: ignore[no-untyped-def]
    chat = [{"role": "user", "content": "a"}, {"role": "", "content": "b"}]
    got = _expect_invalid_field(chat_engine, "chat.messages[1].role", chat=chat_prompt(chat))
    assert got["message"] == "chat.messages[1].role must not be empty, got ''"


def test_a_template_that_raises_is_invalid_field_with_its_message(chat_engine) -> None:  # type: ignore[no-untyped-def]
    got = _expect_invalid_field(chat_engine, "chat.messages", chat=chat_prompt(OUT_OF_ORDER))
    assert "roles user, user" in got["message"]
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in got["message"]
    assert got["info"].metadata["value"] == "user, user"
    # the engine goes on serving
    assert len(tokens_of(decode(chat_engine.stub(), chat=chat_prompt(CHATS[0]), max_new_tokens=3,
                                ignore_eos=True))) == 3


def test_a_rendered_chat_longer_than_the_context_is_context_length_exceeded(chat_engine, reference) -> None:  # type: ignore[no-untyped-def]
    chat = [{"role": "user", "content": "the quick brown fox " * 30}]
    prompt_tokens = len(reference_ids(reference, chat))
    got = expect_error(decode, chat_engine.stub(), chat=chat_prompt(chat), max_new_tokens=64)
    assert got["code"] == grpc.StatusCode.INVALID_ARGUMENT and got["info"].reason == "CONTEXT_LENGTH_EXCEEDED"
    assert dict(got["info"].metadata) == {"promptTokens": str(prompt_tokens), "maxNewTokens": "64",
                                          "maxContextTokens": "256"}


def test_a_chat_far_too_long_is_refused_before_rendering(chat_engine) -> None:  # type: ignore[no-untyped-def]
    chat = [{"role": "user", "content": "x" * 10_000}, {"role": "assistant", "content": "y" * 10_000}]
    got = expect_error(decode, chat_engine.stub(), chat=chat_prompt(chat), max_new_tokens=4)
    assert got["info"].reason == "CONTEXT_LENGTH_EXCEEDED"
    assert got["info"].metadata["promptTokens"] == str(20_000 // 64)
    assert got["message"].startswith("chat.messages with 20000 characters of content is at least 312 tokens")
