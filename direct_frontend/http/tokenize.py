"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, as vLLM serves it.

The router owns each model's tokenizer and chat template, so a client can
count a prompt's tokens exactly as a generation request would be counted
(a chat is rendered by the same template, with the same tools), without an
engine. The bodies are vLLM's, so clients written for its server work here.
"""

from __future__ import annotations

from direct_frontend.http.asgi import JSON, Headers, Send, send_body
from direct_frontend.http.render import render_detokenized, render_tokens
from direct_frontend.openai.errors import invalid_request
from direct_frontend.openai.types import DetokenizeRequest, TokenizeRequest
from direct_frontend.pipeline.models import ServedModel
from direct_frontend.pipeline.preprocess import chat_prompt_ids


async def respond_tokenize(
    served: ServedModel, request: TokenizeRequest, send: Send, headers: Headers,
) -> int:
    """The prompt's token ids (and their strings when asked), and the model's context length."""
    tokenizing = served.tokenizing
    if request.chat is not None:
        _, ids = await chat_prompt_ids(
            request.chat, tokenizing, add_generation_prompt=request.add_generation_prompt,
            add_special_tokens=request.add_special_tokens,
        )
    else:
        assert request.prompt is not None
        ids = tuple(await tokenizing.encode(request.prompt, "prompt",
                                            add_special_tokens=request.add_special_tokens))
    text_model = tokenizing.text_model
    strings = [text_model.id_to_token(i) for i in ids] if request.return_token_strs else None
    await send_body(send, 200, render_tokens(ids, served.context_length, strings), JSON, headers)
    return 200


async def respond_detokenize(
    served: ServedModel, request: DetokenizeRequest, send: Send, headers: Headers,
) -> int:
    """The text of the token ids, special tokens included (as vLLM's server decodes them)."""
    text_model = served.tokenizing.text_model
    vocab = text_model.vocab_size
    for k, token in enumerate(request.tokens):
        if token >= vocab:
            raise invalid_request(f"token ids must be in [0, {vocab}), got {token}",
                                  f"tokens[{k}]")
    prompt = text_model.decode(request.tokens, skip_special_tokens=False)
    await send_body(send, 200, render_detokenized(prompt), JSON, headers)
    return 200
