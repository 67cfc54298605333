"""LLM: offline batch generation over the engine (vLLM's `LLM` API)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.engine.outputs import RequestOutput
from roseray.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    """`LLM(model, **engine_args)`; `generate(prompts, sampling_params)`.

    Engine args are the fields of `roseray.config.EngineConfig` (dtype, device, seed,
    block_size, num_kv_blocks, gpu_memory_utilization, max_model_len, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, enforce_eager, ...).
    """

    def __init__(self, model: str = "random:tiny", **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or lists of token ids); outputs come back in
        the order of the prompts."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")

        engine = self.engine
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, params in zip(request_ids, prompts, sampling_params):
                engine.add_request(request_id, prompt, params, stream_text=False)
        except Exception:
            for request_id in request_ids:
                engine.abort_request(request_id)
            engine.step()  # drain the abort notices
            raise

        finished = {}
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while len(finished) < len(prompts):
                for delta in engine.step():
                    if delta.finished and delta.request_id not in finished:
                        finished[delta.request_id] = delta.request
                        bar.update(1)
        return [self._output(finished[request_id]) for request_id in request_ids]

    def _output(self, req) -> RequestOutput:
        if req.detokenizer is None:  # text was not streamed: decode once at the end
            req.output_text = self.tokenizer.decode(req.output_token_ids,
                                                    skip_special_tokens=req.sampling_params.skip_special_tokens)
        return RequestOutput.from_request(req)
