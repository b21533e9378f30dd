"""Text in and out of a model: tokenizer, chat templates, streaming detokenizer, stops,
and reading a reply's reasoning and tool calls (:class:`OutputParser`).

Nothing here imports transformers or mlx-lm; the ``tokenizers`` library and a
sandboxed jinja2 are all it needs. A generation loop uses it like this::

    tok = Tokenizer.from_dir(model_dir, config_eos=config.eos_token_id)
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    detok, stops = tok.detokenizer(), StopStrings(["</answer>"])
    for token in sampled_ids:
        if token in tok.eos_token_ids:
            detok.finalize()
            yield stops.flush(detok.last_segment)
            break
        detok.add_token(token)
        emit, stop = stops.feed(detok.last_segment)
        yield emit
        if stop is not None:
            break

Stop *token* sequences go before the detokenizer (:class:`StopTokenSequences`),
so their text is never produced.
"""

from mlx_loom.text.chat_template import ChatTemplate
from mlx_loom.text.detokenizer import DecodePlan, StreamingDetokenizer
from mlx_loom.text.output_parser import Content, OutputParser, Reasoning, ToolCallFound
from mlx_loom.text.reasoning import ReasoningFormat, infer_reasoning
from mlx_loom.text.stops import StopCheck, StopStrings, StopTokenSequences
from mlx_loom.text.template_budget import TemplateBudget
from mlx_loom.text.tokenizer import Tokenizer, TokenizerConfig

__all__ = [
    "ChatTemplate",
    "Content",
    "DecodePlan",
    "OutputParser",
    "Reasoning",
    "ReasoningFormat",
    "StopCheck",
    "StopStrings",
    "StopTokenSequences",
    "StreamingDetokenizer",
    "TemplateBudget",
    "Tokenizer",
    "TokenizerConfig",
    "ToolCallFound",
    "infer_reasoning",
]
