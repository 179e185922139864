"""KV cache events in vLLM's format (issue 38): BlockStored / BlockRemoved / AllBlocksCleared, msgpack'd
as vLLM's ``KVEventBatch`` and decoded here with the schema of vLLM's documented subscriber
(``examples/online_serving/kv_events_subscriber.py``, msgspec structs). An indexer that folds the events
knows exactly which prefixes the engine's cache holds; ``minipaged serve --kv-events-config`` sends them
over ZMQ as vLLM does.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Union

import httpx
import pytest
from transformers import AutoTokenizer

msgspec = pytest.importorskip("msgspec", reason="msgspec decodes vLLM's schema: pip install -e '.[test]'")
msgpack = pytest.importorskip("msgpack", reason="the [kv-events] extra: pip install -e '.[kv-events]'")
zmq = pytest.importorskip("zmq", reason="the [kv-events] extra: pip install -e '.[kv-events]'")

from minipaged.kv_events import encode_batch, external_hash  # noqa: E402
from minipaged.request import SamplingParams  # noqa: E402
from serve_util import free_port, running_server  # noqa: E402


# vLLM's documented subscriber's types (examples/online_serving/kv_events_subscriber.py).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Indexer:
    """What a precise router keeps per replica: the hashes cached, and each one's tokens and parent."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[Optional[int], list[int]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert parent is None or parent in self.blocks, "a block stored before its parent"
                    self.blocks[h] = (parent, ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.blocks, "removed a block never stored"
                    del self.blocks[h]
            else:
                self.blocks.clear()

    def prefix_tokens(self, h: int) -> list[int]:
        parent, tokens = self.blocks[h]
        return (self.prefix_tokens(parent) if parent is not None else []) + tokens


def chained_hash(tokens: list[int], block_size: int) -> int:
    """The hash of a prefix's last block, chained from the root as the engine (and vLLM) chains them."""
    from minipaged.block_pool import ROOT_HASH, hash_block_tokens
    h = ROOT_HASH
    for i in range(0, len(tokens), block_size):
        h = hash_block_tokens(h, tokens[i:i + block_size])
    return external_hash(h)


def drain(engine, indexer: Indexer) -> KVEventBatch:
    events, engine.recorder.kv.kv_events = engine.recorder.kv.kv_events, []
    batch = DECODER.decode(msgpack.packb(encode_batch(1.0, events)))
    indexer.apply(batch)
    return batch


def test_an_indexer_following_the_events_knows_exactly_what_is_cached(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=24, block_size=4)
    engine.recorder.kv.kv_events = []
    indexer = Indexer()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = list(range(10, 30))                                    # 5 full blocks shared by two prompts
    seen: list[Any] = []
    for prompt in (shared + [1, 2, 3], shared + [4, 5, 6, 7, 8], list(range(40, 75)), list(range(80, 120))):
        engine.generate([prompt], params)
        seen += drain(engine, indexer).events
        cached = {external_hash(h): b for h, b in engine.kv.pool.hash_to_block.items()}
        assert set(indexer.blocks) == set(cached)                   # after every request, whatever was evicted
        for h in cached:      # each block's prefix, from the events alone, hashes to it as the engine hashes
            assert chained_hash(indexer.prefix_tokens(h), 4) == h
    stored = [e for e in seen if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:20] == shared
    assert all(e.block_size == 4 and e.medium == "GPU" for e in stored)
    assert any(isinstance(e, BlockRemoved) for e in seen), "24 blocks were too many: nothing was evicted"
    first_prompt_blocks = indexer.blocks.keys() & {stored[0].block_hashes[0]}
    assert all(indexer.prefix_tokens(h)[:4] == shared[:4] for h in first_prompt_blocks)
    engine.reset_prefix_cache()
    engine.step()               # KV events leave with a step (the recorder folds the block pool's log), as vLLM's do
    assert isinstance(drain(engine, indexer).events[-1], AllBlocksCleared) and not indexer.blocks


def test_serve_publishes_them_over_zmq(tiny_model, tmp_path):
    port = free_port()
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind(f"tcp://127.0.0.1:{port}")                             # the server connects (vLLM's rule)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
              "topic": "kv-events"}
    try:
        with running_server(tiny_model, "--block-size", "4", "--num-blocks", "128", "--kv-events-config", json.dumps(config),
                            log_path=str(tmp_path / "server.log")) as url:
            tokens = None
            for i in range(10):      # a PUB socket drops what it sends before the link is up: new prompts until
                prompt = f"{i}: a prompt long enough for a few blocks"   # one's blocks arrive (its first block
                #                                                        is new: the digit differs)
                answer = httpx.post(url + "/v1/completions", timeout=30, json={"prompt": prompt, "max_tokens": 2,
                                                                               "temperature": 0}).json()
                tokens = AutoTokenizer.from_pretrained(tiny_model)(prompt).input_ids
                assert answer["usage"]["prompt_tokens"] == len(tokens)
                if sub.poll(1000):
                    break
            assert sub.poll(0), "no KV event batch arrived"
            topic, seq, payload = sub.recv_multipart(zmq.NOBLOCK)
            batch = DECODER.decode(payload)
    finally:
        sub.close()
    assert topic == b"kv-events" and len(seq) == 8
    # They carry every client's prompt tokens to whoever reaches the endpoint: the teacher is told at start.
    log = (tmp_path / "server.log").read_text()
    assert "note: KV cache events carry the token ids of every client's prompt" in log
    assert f"whatever listens at tcp://127.0.0.1:{port}" in log
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None and stored[0].block_size == 4
    assert len(stored[0].token_ids) == 4 * len(stored[0].block_hashes)
    assert stored[0].token_ids == tokens[:len(stored[0].token_ids)]       # the prompt's own tokens, block by block


def test_a_bad_config_is_refused_before_the_model_loads():
    from minipaged.serve.kv_publisher import KVEventsConfig, KVEventsConfigError, exposure_note
    with pytest.raises(KVEventsConfigError, match="replay_endpoint is not supported"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}')
    with pytest.raises(KVEventsConfigError, match="unknown field 'endpont'"):
        KVEventsConfig.parse('{"endpont": "tcp://*:5557"}')
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').endpoint == "tcp://127.0.0.1:5557"
    wide = exposure_note(KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'))
    assert "connect to tcp://*:5557 (every interface: anyone on the network)" in wide and "127.0.0.1" in wide
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}').bind
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://host:5557"}').bind
