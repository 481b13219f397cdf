"""Qwen2.5-Omni as three stages from one checkpoint: thinker -> talker -> code2wav.

`engine: {kind: transformers, model: DIR, args: {part: thinker|talker|token2wav}}` on a
checkpoint whose config is `qwen2_5_omni`. Each stage loads only its part, with transformers'
own class and `from_pretrained(DIR, config=<its sub-config>, key_mapping={"^part.": ""})`, and
computes what `Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)` computes,
split where the model splits (and, with `part: encoder`, its audio and vision encoders in a
stage of their own in front of the thinker: omni_stage.models.qwen_omni.encoder):

- thinker: the chat template, then greedy (or sampled) decoding with a KV cache. Unit `s` is
  generated token `s` with, from the forward that produced it, the input embedding and last
  hidden state of the position it consumed: the prompt's (`prompt_embeds`, `prompt_hidden`,
  [1, P, hidden], in unit 0 only) or token `s - 1`'s. That is all the talker reads.
- talker: prefill on the prompt's hidden+embedding, the voice's text bos and token 0's reply
  state, then one codec code per step, each step fed the next reply state (then the thinker's
  text eos, then its pad) as the model's own forward does. As transformers' `generate` runs it
  (5.x): its attention mask never reaches the talker's forward, so the forward's prefill
  branch does not run: no codec pad/bos embedding on the last two prefill positions, and
  positions count 0, 1, 2, ... (Qwen's original code adds both; with text-only input the
  positions are the same.) We compute what the reference computes; docs/models.md says more.
  Step `k` needs reply state `k`, which the thinker sends with token `k + 1`: on a window
  that ends earlier the talker stops and goes on with the next window, its KV cache kept in
  the request's state. Codes: greedy with the reference's repetition penalty (1.05 over every
  code fed so far) and the codec bos suppressed; it stops at the codec pad or end code.
- token2wav: the DiT (an ODE from noise, 10 Runge-Kutta steps with guidance) and BigVGAN, on
  the whole code sequence or in chunks (`chunkCodes`), each reading what the request kept of
  the chunk before (dit.py): 24 kHz. The noise comes
  from the request's seed (0 by default) exactly as the reference draws it after
  `torch.manual_seed(seed)`.

The request's voice (`audio.voice`, Chelsie or Ethan here) picks the talker's text bos and the
DiT's speaker conditioning; the thinker refuses an unknown one before it starts (a 400).
Each replica runs its forwards on one compute thread: per-request state (KV cache, rope
offsets) lives in the request, never in the model, and the steps of concurrent requests run
as batches (`StepBatcher`): thinker decode steps with their caches stacked (`kv_batch.py`),
talker steps on the replica's slot table (`slot_cache.py`), code2wav chunks of one length and
voice stacked.
"""
