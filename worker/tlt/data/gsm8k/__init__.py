"""GSM8K train split (7,473 problems; OpenAI, MIT licence in LICENSE) shipped inside the package as `train.jsonl`,
so the built-in `gsm8k` dataset works on a worker with no network. Rows: {"question": str, "answer": str}; the
answer ends with `#### <number>`. Loaded by `worker.tlt.data.dataset.load_dataset`."""
