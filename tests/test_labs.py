"""The labs: each lab's checks fail on the untouched stub, pass on the engine's own implementation, and fail on
plausible wrong answers with the message that explains that mistake. The student's side runs as a student's
would: files in a folder, loaded by path, through ``minipaged lab start`` and ``check``.
"""
from __future__ import annotations

import textwrap

import pytest

from minipaged.cli import main
from minipaged.lessons.labs import all_labs, check_file, find_lab

# The engine's own implementation under the name each stub gives it: the reference, loaded as a student's file.
REFERENCE_FILES = {
    1: "from minipaged.policies import LRUFreeBlockQueue as LRUQueue\n",
    2: "from minipaged.block_pool import hash_block_tokens\n",
    3: "from minipaged.policies import PriorityOrder as MyPriority\n",
    4: "from minipaged.lessons.labs.lab4_rejection_sampler import engine_verify as verify\n",
}

# Plausible wrong answers, each with words of the message that must explain it.
WRONG = {
    "lab1-mru": (1, "from minipaged.policies import MRUFreeBlockQueue as LRUQueue\n", "that is MRU"),
    "lab1-list": (1, """
        class LRUQueue:                          # right order, O(n) list operations
            def __init__(self, block_ids): self.q = list(block_ids)
            def __len__(self): return len(self.q)
            def __contains__(self, b): return b in self.q
            def __iter__(self): return iter(self.q)
            def pop_front(self): return self.q.pop(0)
            def push_back(self, b): self.q.append(b)
            def push_front(self, b): self.q.insert(0, b)
            def remove(self, b): self.q.remove(b)
        """, "A list's remove() and pop(0) scan or shift"),
    "lab2-no-parent": (2, """
        import hashlib
        def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
            return hashlib.sha256(repr((list(token_ids), extra_keys)).encode()).digest()
        """, "your hash leaves the parent out"),
    "lab2-python-hash": (2, """
        def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
            return hash((parent_hash, tuple(token_ids), extra_keys)).to_bytes(8, "little", signed=True)
        """, "64-bit hashes"),
    "lab2-digits-glued": (2, """
        import hashlib
        def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
            text = "".join(str(t) for t in token_ids) + repr(extra_keys)
            return hashlib.sha256(parent_hash + text.encode()).digest()
        """, "gluing the ids' digits together"),
    "lab3-higher-first": (3, """
        from minipaged.policies import RequestOrder
        class MyPriority(RequestOrder):
            def key(self, request): return (-request.params.priority, request.arrival_index)
        """, "vLLM serves the *lower* value first"),
    "lab3-starves-the-oldest": (3, """
        from minipaged.policies import RequestOrder
        class MyPriority(RequestOrder):
            def key(self, request): return (request.params.priority, -request.arrival_index)
        """, "it starves"),
    "lab3-ignores-priority": (3, """
        from minipaged.policies import RequestOrder
        class MyPriority(RequestOrder):
            def key(self, request): return request.arrival_index
        """, "ignores request.params.priority"),
    "lab4-recovered-from-p": (4, """
        import torch
        def verify(p, q, draft_token_ids, generator):
            tokens = []
            for i, d in enumerate(draft_token_ids):
                if float(torch.rand((), generator=generator)) * float(q[i, d]) < float(p[i, d]):
                    tokens.append(d)
                    continue
                return tokens + [int(torch.multinomial(p[i], 1, generator=generator))]
            return tokens + [int(torch.multinomial(p[len(draft_token_ids)], 1, generator=generator))]
        """, "drawing the recovered token from p"),
    "lab4-always-accepts": (4, """
        import torch
        def verify(p, q, draft_token_ids, generator):
            bonus = int(torch.multinomial(p[len(draft_token_ids)], 1, generator=generator))
            return list(draft_token_ids) + [bonus]
        """, "every draft seems to be accepted"),
    "lab4-global-random": (4, """
        import torch
        def verify(p, q, draft_token_ids, generator):
            tokens = []
            for i, d in enumerate(draft_token_ids):
                if float(torch.rand(())) * float(q[i, d]) < float(p[i, d]):
                    tokens.append(d)
                    continue
                residual = torch.clamp(p[i] - q[i], min=0)
                return tokens + [int(torch.multinomial(residual / residual.sum(), 1))]
            return tokens + [int(torch.multinomial(p[len(draft_token_ids)], 1))]
        """, "does not come from `generator`"),
}


# A student's answer written from the stub alone: each `raise NotImplementedError(...)` line of the stub is replaced
# by a few lines, and nothing else changes. If a stub leaves out something the engine or the checks use (as lab 1's
# once left out the engine's `ids()`), this fails where the reference answer above cannot.
FROM_THE_STUB = {
    1: {'raise NotImplementedError("LRUQueue.__init__")': "for block_id in block_ids:\n    self._queue[block_id] = None",
        'raise NotImplementedError("LRUQueue.pop_front")': "return self._queue.popitem(last=False)[0]",
        'raise NotImplementedError("LRUQueue.push_back")': "self._queue[block_id] = None",
        'raise NotImplementedError("LRUQueue.push_front")': "self._queue[block_id] = None\n"
                                                            "self._queue.move_to_end(block_id, last=False)",
        'raise NotImplementedError("LRUQueue.remove")': "del self._queue[block_id]"},
    2: {'raise NotImplementedError("hash_block_tokens")':
        "return hashlib.sha256(parent_hash + repr((list(token_ids), extra_keys)).encode()).digest()"},
    3: {'raise NotImplementedError("MyPriority.key")': "return (request.params.priority, request.arrival_index)"},
    4: {'raise NotImplementedError("verify: accept or recover")':
        "if u * float(q[i][token]) < float(p[i][token]):\n"
        "    tokens.append(token)\n"
        "    continue\n"
        "residual = torch.clamp(p[i] - q[i], min=0)\n"
        "tokens.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))\n"
        "return tokens",
        'raise NotImplementedError("verify: the bonus token")':
        "tokens.append(int(torch.multinomial(p[len(draft_token_ids)], 1, generator=generator)))\n"
        "return tokens"},
}


def filled_stub(number: int) -> str:
    """Lab ``number``'s stub with its TODOs done as FROM_THE_STUB says (each line keeps its indentation)."""
    lines = []
    fills = dict(FROM_THE_STUB[number])
    for line in find_lab(number).stub.splitlines():
        code = fills.pop(line.strip(), None)
        indent = line[:len(line) - len(line.lstrip())]
        lines += [indent + piece for piece in code.splitlines()] if code is not None else [line]
    assert not fills, f"lab {number}'s stub no longer has {list(fills)}: update FROM_THE_STUB"
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_a_solution_written_from_the_stub_alone_passes_lab_check(tmp_path, monkeypatch, number, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["lab", "start", str(number)]) == 0
    lab = find_lab(number)
    (tmp_path / lab.file_name).write_text(filled_stub(number))
    code = main(["lab", "check", str(number)])
    out = capsys.readouterr().out
    assert code == 0 and "FAIL" not in out, out


def write(folder, lab, source: str):
    path = folder / lab.file_name
    path.write_text(textwrap.dedent(source))
    return path


@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_the_untouched_stub_fails_every_check(tmp_path, monkeypatch, number, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["lab", "start", str(number)]) == 0
    lab = find_lab(number)
    assert (tmp_path / lab.file_name).read_text() == lab.stub and "TODO" in lab.stub
    assert "minipaged lab check" in (tmp_path / lab.guide_name).read_text()
    results = check_file(lab, tmp_path / lab.file_name)
    assert results and not any(r.passed for r in results)
    assert all("not written yet" in r.message for r in results), [r.message for r in results]
    assert main(["lab", "check", str(number)]) == 1
    assert "0 of" in capsys.readouterr().out


@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_the_engines_own_implementation_passes_every_check(tmp_path, number, capsys):
    lab = find_lab(number)
    path = write(tmp_path, lab, REFERENCE_FILES[number])
    assert main(["lab", "check", str(number), str(path)]) == 0
    assert f"Now watch it run: minipaged watch --lab {number}" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(WRONG))
def test_a_plausible_wrong_answer_fails_with_the_message_that_explains_it(tmp_path, name):
    number, source, words = WRONG[name]
    lab = find_lab(number)
    results = check_file(lab, write(tmp_path, lab, source))
    failures = [r for r in results if not r.passed]
    assert failures, f"{name} passed every check of lab {number}"
    assert any(words in r.message for r in failures), [r.message for r in failures]


def test_list_names_every_lab_and_a_missing_one_is_a_clear_error(capsys):
    assert main(["lab", "list"]) == 0
    out = capsys.readouterr().out
    assert all(lab.title in out for lab in all_labs()) and len(all_labs()) >= 4
    assert main(["lab", "check", "99"]) == 2
    assert "there is no lab 99" in capsys.readouterr().out


def test_start_keeps_a_students_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lab1_lru_queue.py").write_text("# my work\n")
    assert main(["lab", "start", "1"]) == 0
    assert (tmp_path / "lab1_lru_queue.py").read_text() == "# my work\n"
    assert "keeping it" in capsys.readouterr().out


def test_a_file_with_a_syntax_error_or_without_the_name_says_so(tmp_path):
    lab = find_lab(2)
    (result,) = check_file(lab, write(tmp_path, lab, "def hash_block_tokens(:\n"))
    assert not result.passed and "SyntaxError" in result.message
    (result,) = check_file(lab, write(tmp_path, lab, "def hash_blocks(a, b, c): return b''\n"))
    assert not result.passed and "does not define hash_block_tokens" in result.message


# The engine's own implementation, counting its calls: proof that watch --lab runs the student's code.
COUNTING = {
    # lab 1: the queue made from the stub alone (not the engine's class), so watch needs nothing the stub lacks
    1: "FILLED_STUB_1",
    2: """
        from minipaged.block_pool import hash_block_tokens as engine_hash
        CALLS = []
        def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
            CALLS.append(1)
            return engine_hash(parent_hash, token_ids, extra_keys)
        """,
    3: """
        from minipaged.policies import PriorityOrder
        CALLS = []
        class MyPriority(PriorityOrder):
            def key(self, request):
                CALLS.append(1)
                return super().key(request)
        """,
    4: """
        from minipaged.lessons.labs.lab4_rejection_sampler import engine_verify
        CALLS = []
        def verify(p, q, draft_token_ids, generator):
            CALLS.append(1)
            return engine_verify(p, q, draft_token_ids, generator)
        """,
}


@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_watch_lab_runs_the_students_code_beside_the_engines_own(tmp_path, tiny_model, number, capsys):
    import sys
    lab = find_lab(number)
    source = COUNTING[number]
    if source == "FILLED_STUB_1":
        source = filled_stub(1) + textwrap.dedent("""
            CALLS = []
            _pop_front = LRUQueue.pop_front
            def _counted_pop_front(self):
                CALLS.append(1)
                return _pop_front(self)
            LRUQueue.pop_front = _counted_pop_front
            """)
    path = write(tmp_path, lab, source)
    # --rate 4: everyone arrives at once, so lab 3's order has a queue to sort
    code = main(["watch", "--lab", str(number), "--lab-file", str(path), "--no-tui", "--model", tiny_model,
                 "--num-requests", "6", "--max-tokens", "6", "--rate", "4", "--max-num-seqs", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    ours, theirs = [line.split(": ", 1) for line in out.splitlines()[1:3]]
    assert ours[0].strip() == "the engine's own" and theirs[0].strip() == f"yours ({lab.file_name})"
    # the same code gives the same run: steps, tokens per step, preemptions, hit rate (TTFT is wall time)
    assert ours[1].split(", mean TTFT")[0] == theirs[1].split(", mean TTFT")[0]
    # (a policy file is loaded once to check it and once more by the engine's option: count every copy)
    calls = sum(len(m.CALLS) for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))
    assert calls, "the engine never called the student's code"


def test_watch_lab_without_the_file_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["watch", "--lab", "2", "--no-tui"]) == 2
    assert "minipaged lab start" in capsys.readouterr().err
    assert main(["watch", "--lab", "2", "--no-tui", "--replay", "x.jsonl"]) == 2
    assert "does not combine with --replay" in capsys.readouterr().err
