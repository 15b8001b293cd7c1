"""The prompt as ``mlx_lm.generate`` builds it from a command line: the tokenizer's chat template around the
message (by default, when the tokenizer has one), a system prompt, a prefilled start of the reply, keyword
arguments for the template, extra EOS tokens — each under mlx-lm's option name, default and meaning
(:class:`ChatOptions`, the option group of ``smoke-test``; :func:`prompt_ids` builds the tokens).

What mlx-lm would silently ignore is refused in one line instead: a system prompt or a prefilled reply when no
chat template is applied (``--ignore-chat-template``, or a tokenizer without one). ``--use-default-chat-template``
takes the tokenizer's default template when it has none of its own, as ``mlx_lm.server`` means it (transformers
dropped ``default_chat_template`` in 4.43, so a tokenizer without a template is then one line naming the fix;
``mlx_lm.generate`` 0.32 accepts the flag and ignores it).
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from ..core.options import Group, Opt, option
from ..core.ranges import JsonObject
from ..errors import UserError, param

#: ``--use-default-chat-template`` of smoke-test and serve, declared once
USE_DEFAULT_CHAT_TEMPLATE = Opt("Use the tokenizer's default chat template when it has none of its own (as "
                                "mlx_lm.server; recent transformers have none: then one line).")


@dataclass(frozen=True)
class ChatOptions(Group):
    """How the prompt is wrapped, with ``mlx_lm.generate``'s option names, defaults and meanings."""

    system_prompt: str | None = option(None, "System prompt to be used for the chat template.")
    prefill_response: str | None = option(None, "Start of the reply, put in the chat template as the assistant's "
                                          "message, which the model continues.")
    ignore_chat_template: bool = option(False, "Use the raw prompt without the tokenizer's chat template.")
    use_default_chat_template: bool = option(False, USE_DEFAULT_CHAT_TEMPLATE.help)
    chat_template_config: dict | None = option(
        None, "Additional keyword arguments for the chat template, as a JSON object (e.g. "
        "'{\"enable_thinking\": false}').", type=JsonObject(), metavar="JSON", default_text="{}")
    extra_eos_token: tuple[str, ...] = option(
        (), "Another token that stops generation (a token or its id); repeat the option for more (mlx-lm takes "
        "several after one flag).", type=click.STRING, multiple=True, metavar="TOKEN")

    def validate(self) -> None:
        if self.ignore_chat_template:
            for name in ("system_prompt", "prefill_response"):
                if getattr(self, name) is not None:
                    raise UserError(f"{param(name)} goes into the chat template, which {param('ignore_chat_template')}"
                                    f" turns off; drop one of them.")
            if self.chat_template_config:
                raise UserError(f"{param('chat_template_config')} is for the chat template, which "
                                f"{param('ignore_chat_template')} turns off; drop one of them.")


def use_default_template(tokenizer) -> None:
    """Give ``tokenizer`` (mlx-lm's wrapper) its default chat template when it has none of its own; one line when
    there is no default either."""
    if tokenizer.has_chat_template:
        return
    default = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "default_chat_template", None)
    if not default:
        raise UserError(f"{param('use_default_chat_template')}: the tokenizer has no chat template and no default one "
                        f"(transformers dropped default templates); give a template ({param('chat_template')} under "
                        f"serve) or drop the option.")
    tokenizer.chat_template = default
    tokenizer.has_chat_template = True


def prompt_ids(tokenizer, prompt: str, options: ChatOptions) -> list[int]:
    """The prompt's tokens as ``mlx_lm.generate`` makes them: with the chat template (when the tokenizer has one
    and ``ignore_chat_template`` is off) the optional system message, the user message and the optional prefilled
    reply (continued, no generation prompt then), rendered with ``chat_template_config`` and encoded without special
    tokens; else the raw text with the tokenizer's special tokens (its BOS, if it has one), as mlx-lm's command line
    encodes it."""
    if options.use_default_chat_template and not options.ignore_chat_template:
        use_default_template(tokenizer)
    if options.ignore_chat_template or not tokenizer.has_chat_template:
        for name in ("system_prompt", "prefill_response"):
            if getattr(options, name) is not None:
                raise UserError(f"{param(name)} goes into the chat template, and the tokenizer has none; drop it (or "
                                f"pass {param('use_default_chat_template')}).")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    messages = [] if options.system_prompt is None else [{"role": "system", "content": options.system_prompt}]
    messages.append({"role": "user", "content": prompt})
    prefill = options.prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": options.prefill_response})
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=prefill,
                                             add_generation_prompt=not prefill,
                                             **(options.chat_template_config or {}))
    except (TemplateError, TypeError, ValueError, KeyError) as e:
        raise UserError(f"the chat template failed on this prompt ({type(e).__name__}: {str(e)[:200]}); check "
                        f"{param('chat_template_config')} / {param('system_prompt')}, or pass "
                        f"{param('ignore_chat_template')}.") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def add_eos_tokens(tokenizer, tokens) -> None:
    """mlx-lm's ``add_eos_token`` for each of ``tokens`` (a token, or its id); one line for one the tokenizer lacks."""
    for token in tokens:
        try:
            tokenizer.add_eos_token(token)
        except ValueError:
            raise UserError(f"{param('extra_eos_token')} {token!r} is not a token of this tokenizer; give a token "
                            f"of its vocabulary or its id.") from None


__all__ = ["USE_DEFAULT_CHAT_TEMPLATE", "ChatOptions", "add_eos_tokens", "prompt_ids", "use_default_template"]
