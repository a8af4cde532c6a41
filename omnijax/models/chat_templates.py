"""The chat templates omnijax ships for checkpoints without their own: Qwen2.5-Omni's ChatML layout and MiniCPM-o 4.5
in the Qwen3 layout (Jinja sources, rendered by `omnijax.models.tokenizer.Tokenizer`, which re-exports both)."""

from __future__ import annotations

__all__ = ["CHATML_TEMPLATE", "MINICPMO_4_5_TEMPLATE"]

# Qwen2.5-Omni's ChatML layout. Content parts: text as is, audio/image/video as the Omni placeholders between their
# markers, concatenated. No default system message is inserted: the transformers processor of Qwen2.5-Omni (5.2.0)
# only warns when the system prompt is not the one its speech output expects, and the release's template file is
# not available here to confirm one.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'audio' %}{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{%- elif part['type'] == 'image' %}{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{%- else %}{{- raise_exception('unsupported content part type: ' ~ part['type']) }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# MiniCPM-o 4.5 (a Qwen3 LLM) in the Qwen3 chat layout. Choices made here (this is our template, not the release's):
# - content parts are joined with "\n" as MiniCPM-o's chat code joins a message's items; images and audio render as
#   the release's placeholders `<image>./</image>` and `<audio>./</audio>` (its processor expands them);
# - thinking is off unless `enable_thinking=True` is passed: the generation prompt then ends with the empty think
#   block `<think>\n\n</think>\n\n` (Qwen3 defaults to thinking; MiniCPM-o's chat use does not think);
# - `use_tts_template=True` appends `<|tts_bos|>` after the generation prompt, as the release's speech chat does
#   (the golden prompt `tests/data/minicpmo45/case5_chat.json` ends so);
# - as in Qwen3, assistant turns before the last user turn lose their `<think>...</think>` part, later ones keep it
#   (an empty one when the message is the last), a run of tool messages becomes one user turn of
#   `<tool_response>` blocks, and tool schemas (`tools=`) are refused.
MINICPMO_4_5_TEMPLATE = (
    "{%- if tools %}{{- raise_exception('this chat template does not render tools') }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set parts = namespace(texts=[]) %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{%- set parts.texts = parts.texts + [part['text']] %}"
    "{%- elif part['type'] == 'image' %}{%- set parts.texts = parts.texts + ['<image>./</image>'] %}"
    "{%- elif part['type'] == 'audio' %}{%- set parts.texts = parts.texts + ['<audio>./</audio>'] %}"
    "{%- else %}{{- raise_exception('unsupported content part type: ' ~ part['type']) }}"
    "{%- endif %}{%- endfor %}{%- set content = parts.texts | join('\\n') %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if not (enable_thinking is defined and enable_thinking) %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if use_tts_template is defined and use_tts_template %}{{- '<|tts_bos|>' }}{%- endif %}"
    "{%- endif %}"
)
