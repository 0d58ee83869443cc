"""A model's chat template: Jinja source compiled once at load, rendered per request exactly as
transformers' `apply_chat_template(messages, add_generation_prompt=True)` renders it.

The environment copies transformers' (`utils/chat_template_utils.py`): an immutable sandbox with
trim_blocks and lstrip_blocks, the loopcontrols extension, a `{% generation %}` block that renders
its body, the `tojson` filter without HTML escaping, and the globals `raise_exception`,
`strftime_now`, `dict` and `namespace` (the last two restricted as transformers restricts them).
The variables are `messages`, `tools` and `documents` (None), `add_generation_prompt` and the
tokenizer's named special tokens (`bos_token`, `eos_token`, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine_service.model.checkpoint_config import read_json

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names under which apply_chat_template passes them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What a template can raise while rendering one conversation: its own raise_exception and Jinja's
# errors (TemplateError), and Python errors of the operations it runs on the request's values.
# Each is the conversation's fault as far as the engine can tell, never the engine's.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError)


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that refuses a conversation."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ChatTemplate:
    """`source` is the Jinja text; `origin` says where it came from (for load errors);
    `special_tokens` holds other named special tokens (unk_token, pad_token, ...) by name."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict, hash=False)
    origin: str = "chat template"
    _template: jinja2.Template = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        try:
            template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"{self.origin} is not a valid Jinja template: {err} (line {err.lineno})") from err
        object.__setattr__(self, "_template", template)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The conversation as the model's prompt text, ending with the assistant's turn opened.
        Raises ChatTemplateError with the template's own message when the template refuses it."""
        variables = {**self.special_tokens}
        for name, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)):
            if value is not None:
                variables[name] = value
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(messages=chat, tools=None, documents=None, add_generation_prompt=True,
                                         **variables)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(str(err) or type(err).__name__) from err
        except _RENDER_ERRORS as err:
            raise ChatTemplateError(f"{type(err).__name__}: {err}") from err


def load_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face checkpoint directory, as transformers finds it:
    `chat_template.jinja`, else `tokenizer_config.json`'s "chat_template" (a string, or a list of
    {"name", "template"} of which "default" is used); None when there is none. The special tokens
    come from tokenizer_config.json, else special_tokens_map.json. Raises ChatTemplateError naming
    the file when the template is malformed."""
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = read_json(config_path) if config_path.exists() else {}
    template_path = directory / CHAT_TEMPLATE_FILE
    if template_path.exists():
        origin = f"chat template {str(template_path)!r}"
        try:
            source = template_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ChatTemplateError(f"{origin} is unreadable: {err}") from err
    else:
        origin = f"chat_template of {str(config_path)!r}"
        source = _default_template(config.get("chat_template"), origin)
        if source is None:
            return None
    tokens = _special_tokens(directory, config)
    return ChatTemplate(source, bos_token=tokens.pop("bos_token", None), eos_token=tokens.pop("eos_token", None),
                        special_tokens=tokens, origin=origin)


def _default_template(value: Any, origin: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(f"{origin} is a list of templates without a \"default\" one, got names {list(named)}")
    raise ChatTemplateError(f"{origin} must be a string or a list of {{name, template}}, got {type(value).__name__}")


def _special_tokens(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    legacy_path = directory / SPECIAL_TOKENS_MAP_FILE
    legacy = read_json(legacy_path) if legacy_path.exists() else {}
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name, legacy.get(name))
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str):
            tokens[name] = content
    return tokens


# -- the environment, as transformers builds it -------------------------------------------------
def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not, and exposes these options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the type's attributes (no sandbox escape)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore-prefixed attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick: `self` taken from args, so `namespace(self=...)` stays a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it for
    training masks): here it renders its body and nothing else."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
