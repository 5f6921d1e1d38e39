"""A tiny Hugging Face tokenizer directory built in the test (CI has no network): a byte-level
BPE trained on a few sentences with the `tokenizers` library, and the tokenizer_config.json
(Qwen2.5's ChatML template) and generation_config.json a real checkpoint ships with it.

    tok_dir = make_tokenizer_dir(tmp_path / "tok")      # tokenizer.json, tokenizer_config.json, ...
"""
from __future__ import annotations

import json
import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["hello world, héllo wörld", "the quick brown fox jumps over the lazy dog",
          "世界 你好 世界", "🙂 smile 🙂", "<|im_start|>user\nhi<|im_end|>\n"]

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json carries it
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")


def train_tokenizer(vocab_size: int = 300, bos: str | None = None):
    """A byte-level BPE (Qwen2/Llama 3 style: ByteLevel pre-tokenizer and decoder); with `bos`,
    a post-processor that puts that token first, as Llama 3's tokenizer.json does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIALS + ([bos] if bos else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def make_tokenizer_dir(path, *, eos_token_id: object = "default", chat_template: object = QWEN25_TEMPLATE,
                       bos: str | None = None, config: dict | None = None, generation_config: bool = True) -> str:
    """A checkpoint directory's tokenizer files. `eos_token_id` goes into generation_config.json
    as given (default: Qwen2.5-Instruct's list, <|im_end|> then <|endoftext|>), unless
    `generation_config` is False; `config` entries override tokenizer_config.json's."""
    os.makedirs(path, exist_ok=True)
    tok = train_tokenizer(bos=bos)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": bos, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 32768, "errors": "replace",
           "chat_template": chat_template, **(config or {})}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    if eos_token_id == "default":
        eos_token_id = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    if generation_config:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": 0, "eos_token_id": eos_token_id, "do_sample": False}, f)
    return str(path)
