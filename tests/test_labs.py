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
    5: "from minipaged.kernels.reference import paged_attention_reference as paged_attention\n",
    6: "from minipaged.lessons.labs.lab6_preemption import engine_preempt as preempt\n",
    7: "from minipaged.lessons.labs.lab7_schedule import engine_schedule as schedule\n",
}

# Lab 5's answer with one piece swappable: each wrong answer below changes exactly one.
LAB5 = """
    import torch
    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
        out = torch.empty_like(q)
        for i in range(len(seq_lens)):
            seq_len, qs, qe = int(seq_lens[i]), int(query_start_loc[i]), int(query_start_loc[i + 1])
            q_len = qe - qs
            blocks = block_tables[i, :(seq_len + block_size - 1) // block_size].long()
            keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1]){END}
            values = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[-1]){END}
            group = num_heads // num_kv_heads
            keys, values = {REPEAT}(keys).float(), {REPEAT}(values).float()
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * scale
            first = {FIRST}
            pos = torch.arange(first, first + q_len)[:, None]
            if q_len > 1:                  # a decode sees every key it has: no mask
                scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > pos, float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        return out
    """


def lab5(end="[:seq_len]", repeat="(lambda x: x.repeat_interleave(group, dim=1))", first="seq_len - q_len") -> str:
    return LAB5.replace("{END}", end).replace("{REPEAT}", repeat).replace("{FIRST}", first)


# Lab 6's answer, each wrong one with one line changed.
LAB6 = """
    from minipaged.request import RequestStatus
    def preempt(scheduler, victim):
        scheduler.running.remove(victim)
        {FREE}
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        {REQUEUE}
        {EXTRA}
    """


def lab6(free="scheduler.kv.free(victim, forget_hashes=False)", requeue="scheduler.waiting.appendleft(victim)",
         extra="pass") -> str:
    return LAB6.replace("{FREE}", free).replace("{REQUEUE}", requeue).replace("{EXTRA}", extra)


# Lab 7's answer, written as the stub asks; each wrong one changes one piece.
LAB7 = """
    from minipaged.request import RequestStatus
    from minipaged.scheduler import SchedulerOutput
    def preempt(scheduler, victim, out):
        {PREEMPT}
    def admit(scheduler, out, budget):
        while scheduler.waiting and budget > 0 and len(scheduler.running) < scheduler.config.max_num_seqs:
            req = scheduler.waiting[0]
            num_new = {ADMIT_NUM_NEW}
            if not scheduler.kv.allocate_slots(req, num_new, 0):
                break
            scheduler.waiting.popleft()
            req.status = RequestStatus.RUNNING
            scheduler.running.append(req)
            out.chunks.append(scheduler._chunk(req, 0, num_new))
            budget -= num_new
        return budget
    def schedule(scheduler):
        out = SchedulerOutput()
        budget = scheduler.config.max_num_batched_tokens
        {WAITING_FIRST}
        scheduled = set()
        for req in list(scheduler.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in scheduled:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not scheduler.kv.allocate_slots(req, num_new):
                victim = max((r for r in scheduler.running if r.request_id not in scheduled),
                             key=lambda r: r.arrival_index)
                preempt(scheduler, victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                out.chunks.append(scheduler._chunk(req, req.num_computed_tokens, num_new))
                scheduled.add(req.request_id)
                budget -= num_new
        if not out.preempted:
            admit(scheduler, out, budget)
        return out
    """


def lab7(preempt="scheduler._preempt(victim, out)", admit_num_new="min(req.num_tokens, budget)",
         waiting_first="pass") -> str:
    return (LAB7.replace("{PREEMPT}", preempt).replace("{ADMIT_NUM_NEW}", admit_num_new)
            .replace("{WAITING_FIRST}", waiting_first))


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
    "lab5-mask-from-the-chunk-start": (5, lab5(first="0"), "the causal mask of a chunk that starts mid-prompt"),
    "lab5-no-mask": (5, lab5(first="10**9"), "the causal mask of a chunk that starts mid-prompt"),
    "lab5-whole-last-block": (5, lab5(end=""), "you read slots past seq_len"),
    "lab5-gqa-repeat": (5, lab5(repeat="(lambda x: x.repeat(1, group, 1))"), "the GQA head mapping is wrong"),
    "lab6-keeps-its-blocks": (6, lab6(free="pass"), "A preempted request that keeps its blocks is a leak"),
    "lab6-loses-its-tokens": (6, lab6(extra="victim.output_token_ids.clear()"),
                              "A preempted request that loses its generated tokens changes its outputs"),
    "lab6-back-of-the-queue": (6, lab6(requeue="scheduler.waiting.append(victim)"),
                               "put at the back of the queue loses its turn"),
    "lab6-keeps-its-progress": (6, lab6(extra="victim.num_computed_tokens = 5"), "Set num_computed_tokens to 0"),
    "lab7-prefill-overruns-the-budget": (7, lab7(admit_num_new="req.num_tokens"),
                                         "A prefill that overruns the budget"),
    "lab7-long-prompt-starves-decodes": (7, lab7(waiting_first="budget = admit(scheduler, out, budget)"),
                                         "Decodes starved by a long prompt"),
    "lab7-preempted-keeps-its-blocks": (7, lab7(preempt="scheduler.running.remove(victim); "
                                                        "victim.status = RequestStatus.WAITING; "
                                                        "victim.num_computed_tokens = 0; "
                                                        "scheduler.waiting.appendleft(victim)"),
                                        "A preempted request that keeps its blocks leaks them"),
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
    5: {'raise NotImplementedError("paged_attention: gather the keys and values")':
        "blocks = block_tables[i, :(seq_len + block_size - 1) // block_size].long()\n"
        "keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1])[:seq_len]\n"
        "values = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[-1])[:seq_len]",
        'raise NotImplementedError("paged_attention: map query heads to KV heads")':
        "keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)\n"
        "values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)",
        'raise NotImplementedError("paged_attention: scores, mask, softmax")':
        "scores = torch.einsum('qhd,khd->hqk', q[qs:qe].float(), keys.float()) * scale\n"
        "position = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]\n"
        "future = torch.arange(seq_len, device=q.device)[None, :] > position\n"
        "weights = scores.masked_fill(future, float('-inf')).softmax(dim=-1)\n"
        "out[qs:qe] = torch.einsum('hqk,khd->qhd', weights, values.float()).to(q.dtype)"},
    6: {'raise NotImplementedError("preempt: stop running")': "scheduler.running.remove(victim)",
        'raise NotImplementedError("preempt: give the blocks back")': "scheduler.kv.free(victim, forget_hashes=False)",
        'raise NotImplementedError("preempt: what it has left")':
        "victim.num_computed_tokens = 0\nvictim.status = RequestStatus.WAITING",
        'raise NotImplementedError("preempt: requeue")': "scheduler.waiting.appendleft(victim)"},
    7: {'raise NotImplementedError("schedule: running requests")':
        "num_new = min(req.num_tokens - req.num_computed_tokens, budget)\n"
        "while not scheduler.kv.allocate_slots(req, num_new, req.num_computed_tokens):\n"
        "    victim = max((r for r in scheduler.running if r.request_id not in scheduled),\n"
        "                 key=lambda r: r.arrival_index)\n"
        "    scheduler._preempt(victim, out)\n"
        "    if victim is req:\n"
        "        break\n"
        "if req.status is RequestStatus.RUNNING:\n"
        "    out.chunks.append(scheduler._chunk(req, req.num_computed_tokens, num_new))\n"
        "    scheduled.add(req.request_id)\n"
        "    budget -= num_new",
        'raise NotImplementedError("schedule: waiting requests")':
        "while scheduler.waiting and budget > 0 and len(scheduler.running) < scheduler.config.max_num_seqs:\n"
        "    req = scheduler.waiting[0]\n"
        "    num_new = min(req.num_tokens, budget)\n"
        "    if not scheduler.kv.allocate_slots(req, num_new, 0):\n"
        "        break\n"
        "    scheduler.waiting.popleft()\n"
        "    req.status = RequestStatus.RUNNING\n"
        "    scheduler.running.append(req)\n"
        "    out.chunks.append(scheduler._chunk(req, 0, num_new))\n"
        "    budget -= num_new"},
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


@pytest.mark.parametrize("number", [1, 2, 3, 4, 5, 6, 7])
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


@pytest.mark.parametrize("number", [1, 2, 3, 4, 5, 6, 7])
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


@pytest.mark.parametrize("number", [1, 2, 3, 4, 5, 6, 7])
def test_the_engines_own_implementation_passes_every_check(tmp_path, number, capsys):
    lab = find_lab(number)
    path = write(tmp_path, lab, REFERENCE_FILES[number])
    assert main(["lab", "check", str(number), str(path)]) == 0
    assert f"Now watch it run: minipaged watch --lab {number}" in capsys.readouterr().out


@pytest.mark.parametrize("number, source", [(5, lab5()), (6, lab6()), (7, lab7())], ids=["lab5", "lab6", "lab7"])
def test_the_answer_each_wrong_one_is_made_from_passes(tmp_path, number, source):
    """Each wrong answer of labs 5-7 is this answer with one piece changed: the piece is the mistake."""
    lab = find_lab(number)
    results = check_file(lab, write(tmp_path, lab, source))
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]


def test_lab1_engine_check_fails_an_mru_queue_made_with_popitem(tmp_path):
    """popitem() pops the newest entry (last=True): the engine check must fail it too, not only the order check."""
    lab = find_lab(1)
    source = filled_stub(1).replace("self._queue.popitem(last=False)", "self._queue.popitem()")
    results = {r.title: r for r in check_file(lab, write(tmp_path, lab, source))}
    engine = results["inside the engine's KVCacheManager, the books balance and prefixes are shared and evicted LRU"]
    assert not engine.passed and "that is MRU" in engine.message


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
    assert all(lab.title in out for lab in all_labs()) and len(all_labs()) >= 7
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
    5: """
        from minipaged.kernels.reference import paged_attention_reference
        CALLS = []
        def paged_attention(*args):
            CALLS.append(1)
            return paged_attention_reference(*args)
        """,
    6: """
        from minipaged.lessons.labs.lab6_preemption import engine_preempt
        CALLS = []
        def preempt(scheduler, victim):
            CALLS.append(1)
            engine_preempt(scheduler, victim)
        """,
    7: """
        from minipaged.lessons.labs.lab7_schedule import engine_schedule
        CALLS = []
        def schedule(scheduler):
            CALLS.append(1)
            return engine_schedule(scheduler)
        """,
}

# Engine flags a lab's watch needs to show its code at work: lab 6's preemptions need a pool too small.
WATCH_FLAGS = {6: ["--workload", "chat", "--max-tokens", "24", "--num-blocks", "14", "--block-size", "8",
                  "--max-num-seqs", "4"]}


@pytest.mark.parametrize("number", [1, 2, 3, 4, 5, 6, 7])
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
                 "--num-requests", "6", "--max-tokens", "6", "--rate", "4", "--max-num-seqs", "2",
                 *WATCH_FLAGS.get(number, [])])
    out = capsys.readouterr().out
    assert code == 0, out
    ours, theirs = [line.split(": ", 1) for line in out.splitlines()[1:3]]
    assert ours[0].strip() == "the engine's own" and theirs[0].strip() == f"yours ({lab.file_name})"
    # the same code gives the same run: steps, tokens per step, preemptions, hit rate (TTFT is wall time)
    assert ours[1].split(", mean TTFT")[0] == theirs[1].split(", mean TTFT")[0]
    # (a policy file is loaded once to check it and once more by the engine's option: count every copy)
    calls = sum(len(m.CALLS) for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))
    assert calls, "the engine never called the student's code"
    if number == 6:
        assert " 0 preemptions" not in out, out


def test_watch_lab_without_the_file_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["watch", "--lab", "2", "--no-tui"]) == 2
    assert "minipaged lab start" in capsys.readouterr().err
    assert main(["watch", "--lab", "2", "--no-tui", "--replay", "x.jsonl"]) == 2
    assert "does not combine with --replay" in capsys.readouterr().err
