"""Load exports with the transformers release on the path (the floor lane puts .lanes/hf-floor first) and print what
they give, for tests/vllm/test_export_transformers_floor.py to compare with today's transformers and our model.

    PYTHONPATH=.lanes/hf-floor python tests/vllm/hf_floor_load.py REQUEST.json   ->   one JSON line on stdout

REQUEST: {"tokenizers": {name: DIR}, "text": str, "messages": [...], "policy": DIR, "ids": [...]}
"""

from __future__ import annotations

import json
import sys


def main(request_path: str) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    req = json.loads(open(request_path).read())
    tokenizers = {}
    for name, path in req["tokenizers"].items():
        tok = AutoTokenizer.from_pretrained(path)
        tokenizers[name] = {
            "class": type(tok).__name__,
            "ids": tok.encode(req["text"], add_special_tokens=False),
            "eos_pad": [tok.eos_token_id, tok.pad_token_id],
            "chat": tok.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
            if tok.chat_template else None,
        }
    model = AutoModelForCausalLM.from_pretrained(req["policy"], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([req["ids"]])).logits[0]
    answer = {"version": transformers.__version__, "tokenizers": tokenizers, "logits": logits.tolist()}
    print("HF_FLOOR " + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
