"""Chat: a streaming conversation with the served model (system prompt, temperature, max tokens)."""

from __future__ import annotations

from collections.abc import Iterator

from ..client import ServerClient
from ..common import Context, problem

WAITING = "…"


def messages_for(history: list[dict], system: str, user: str) -> list[dict]:
    """The request's messages: the system prompt (if any), the conversation so far, the new user turn."""
    msgs = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    msgs += [{"role": m["role"], "content": text_of(m.get("content"))} for m in history
             if m.get("role") in ("user", "assistant")]
    return msgs + [{"role": "user", "content": user}]


def text_of(content) -> str:
    """A chat message's text, whether gradio hands it over as a string or as a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(text_of(c) for c in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return "" if content is None else str(content)


def stream_reply(client: ServerClient, user: str, history: list[dict] | None, system: str = "",
                 temperature: float = 0.0, max_tokens: int = 128) -> Iterator[tuple[list[dict], str, str]]:
    """Yields ``(conversation, message box, status line)`` as the reply streams in. On a failure the status is
    one line; what arrived is kept, and when nothing did the user's message goes back into the box to resend."""
    history = [{"role": m["role"], "content": text_of(m.get("content"))} for m in history or []]
    if not user or not user.strip():
        yield history, user or "", "Type a message first."
        return
    msgs = messages_for(history, system, user)
    history = history + [{"role": "user", "content": user}, {"role": "assistant", "content": ""}]
    yield history, "", WAITING
    try:
        for piece in client.chat(msgs, temperature=temperature, max_tokens=int(max_tokens)):
            history = [*history[:-1], {"role": "assistant", "content": history[-1]["content"] + piece}]
            yield history, "", WAITING
    except Exception as e:  # noqa: BLE001 - one line on the page, the conversation kept
        if history[-1]["content"]:
            yield history, "", problem(e)
        else:
            yield history[:-2], user, problem(e)
        return
    if not history[-1]["content"]:
        history = [*history[:-1], {"role": "assistant", "content": "(empty reply: the model ended at once)"}]
    yield history, "", ""


def build(ctx: Context) -> None:
    import gradio as gr

    chatbot = gr.Chatbot(label="Conversation", height=380, elem_id="chatbot")
    with gr.Row():
        msg = gr.Textbox(label="Message", placeholder="Ask the model…", scale=5, elem_id="chat-input")
        send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
    with gr.Row():
        system = gr.Textbox(label="System prompt", lines=1, scale=3)
        temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature", scale=1)
        max_tokens = gr.Slider(1, 2048, value=128, step=1, label="Max tokens", scale=1, elem_id="chat-max-tokens")
    status = gr.Markdown(elem_id="chat-status")
    clear = gr.Button("Clear conversation", size="sm")

    def respond(user, history, system_prompt, temp, limit):
        yield from stream_reply(ctx.client, user, history, system_prompt, temp, limit)

    for trigger in (send.click, msg.submit):
        trigger(respond, [msg, chatbot, system, temperature, max_tokens], [chatbot, msg, status],
                show_progress="hidden")
    clear.click(lambda: ([], ""), None, [chatbot, status])
