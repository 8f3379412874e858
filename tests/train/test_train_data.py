"""Datasets: built-ins, JSONL/parquet with column mapping and chat prompts, the validation split, the resumable
sampler, prompt rendering, update-batch packing and token-budget micro-batches.

Run: python -m pytest tests/train/test_train_data.py -q
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from worker.tlt.config import DatasetSource
from worker.tlt.data.dataset import Example, load_examples, split_examples
from worker.tlt.data.prompts import render, render_examples, to_messages
from worker.tlt.data.sampler import PromptSampler
from worker.tlt.model.tokenizer import ByteTokenizer
from worker.tlt.rl.batch import UpdateSeq, pack, split_by_budget


def test_builtin_gsm8k_ships_with_the_package() -> None:
    rows = load_examples(DatasetSource(builtin="gsm8k"))
    assert len(rows) == 7473
    assert rows[0].prompt.startswith("Natalia sold clips") and rows[0].answer.endswith("#### 72")
    train, val = split_examples(rows, 64)
    assert len(val) == 64 and val[-1] is rows[-1] and len(train) == 7473 - 64
    lic = Path(__file__).resolve().parents[2] / "worker/tlt/data/gsm8k/LICENSE"
    assert "MIT License" in lic.read_text()


def test_toy_count_rows() -> None:
    rows = load_examples(DatasetSource(builtin="toy-count"))
    assert rows[1].prompt == "Write the letter b many times: " and rows[1].answer == "b"


def test_toy_times_rows_vary_letter_and_count() -> None:
    rows = load_examples(DatasetSource(builtin="toy-times"))
    assert rows[1].prompt == "Write the letter b 3 times: " and rows[1].answer == "bbb"
    assert rows[4].prompt == "Write the letter b 4 times: " and rows[4].answer == "bbbb"
    pairs = {(r.answer[0], len(r.answer)) for r in rows}
    assert len(pairs) == 3 * 6  # every letter with every count, so a group's best answer depends on its prompt
    assert all(f" {len(r.answer)} times" in str(r.prompt) for r in rows)


def test_jsonl_and_parquet_with_column_mapping(tmp_path: Path) -> None:
    recs = [
        {"q": "What is 2+2?", "gt": "4"},
        {"q": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "3*3?"}], "gt": "9"},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    src = DatasetSource(path=str(tmp_path / "d.jsonl"), prompt_column="q", answer_column="gt")
    rows = load_examples(src)
    assert rows[0] == Example("What is 2+2?", "4", 0)
    assert rows[1].prompt[0] == {"role": "system", "content": "Be terse."}
    pq.write_table(pa.Table.from_pylist([{"q": "x?", "gt": 5}]), tmp_path / "d.parquet")
    rows = load_examples(DatasetSource(path=str(tmp_path / "d.parquet"), prompt_column="q", answer_column="gt"))
    assert rows == [Example("x?", "5", 0)]
    with pytest.raises(ValueError, match="needs columns"):
        load_examples(DatasetSource(path=str(tmp_path / "d.jsonl")))  # default columns question/answer absent
    (tmp_path / "ds1.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    assert load_examples(DatasetSource(dataset_id="ds1"), datasets_dir=tmp_path)[0].answer == "a"


def test_system_prompt_and_chat_template() -> None:
    assert to_messages("hi", "SYS") == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]
    chat = [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]
    assert to_messages(chat, "SYS") == chat  # a chat's own system message wins
    tok = ByteTokenizer()
    r = render(Example("hi", "1", 0), tok, "SYS")
    assert r.text == "<system>SYS\n<user>hi\n<assistant>" and list(r.ids) == list(r.text.encode())
    kept = render_examples([Example("hi", "1", 0), Example("x" * 100, "1", 1)], tok, None, max_prompt_length=40)
    assert [k.example.index for k in kept] == [0]


def test_sampler_is_seeded_epochs_and_resumes() -> None:
    s = PromptSampler(list(range(5)), seed=3)
    first = s.next_batch(3)
    state = s.state_dict()
    rest = s.next_batch(6)  # crosses into epoch 1
    assert sorted(first + rest[:2]) == [0, 1, 2, 3, 4]
    t = PromptSampler(list(range(5)), seed=3)
    t.load_state_dict(state)
    assert t.next_batch(6) == rest
    assert PromptSampler(list(range(5)), seed=4).next_batch(5) != first + rest[:2]


def test_pack_aligns_mask_with_response_targets() -> None:
    seqs = [UpdateSeq([1, 2, 3], [7, 8], 0.5, [-0.1, -0.2]), UpdateSeq([4], [9, 10, 11], -1.0, [-1.0, -2.0, -3.0])]
    mb = pack(seqs, pad_id=0, device="cpu")
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]]
    assert mb.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert (mb.targets * mb.mask.long()).tolist() == [[0, 0, 7, 8], [9, 10, 11, 0]]
    assert torch.allclose(mb.rollout_logp, torch.tensor([[0, 0, -0.1, -0.2], [-1.0, -2.0, -3.0, 0]]))


def test_micro_batches_respect_the_padded_token_budget() -> None:
    seqs = [UpdateSeq([1] * n, [2], 0.0, None) for n in (3, 3, 9, 1, 1, 20)]
    groups = split_by_budget(seqs, token_budget=12)
    assert [[len(x) for x in g] for g in groups] == [[4, 4], [10], [2, 2], [21]]
    assert all(len(g) * max(len(x) for x in g) <= 12 for g in groups[:-1])  # an oversize one stands alone
