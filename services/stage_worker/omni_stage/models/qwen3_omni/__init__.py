"""Qwen3-Omni as three stages from one checkpoint: thinker -> talker -> code2wav.

`engine: {kind: transformers, model: DIR, args: {part: thinker|talker|code2wav}}` on a
checkpoint whose config is `qwen3_omni_moe`. Each stage loads only its part with transformers'
own class, as for Qwen2.5-Omni (models/qwen_omni, whose thinker this one is but for what it sends),
and computes what `Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)`
computes with greedy decoding (`talker_do_sample=False`), split where the model splits:

- thinker: the MoE thinker, its prompt built as `Qwen3OmniMoeProcessor` builds it (its audio
  features padded to the longest clip, its own audio lengths and video bounds). Unit 0 carries
  the prompt's ids, input embeddings and hidden states of the layer the talker reads
  (`accept_hidden_layer`), with the media's layout; unit `s` the input embedding of token
  `s - 1` (the talker reads the reply's embeddings only).
- talker: its prompt is the user turns (text positions: the thinker's embeddings through its
  text projection; media positions: the thinker's hidden states through its hidden
  projection) and the assistant's start (3 tokens, 4 pads and the TTS bos, the first reply
  token, each with its codec control code and the voice's speaker code). Each step picks the
  first codebook's code (greedy, repetition penalty 1.05 over the codes so far, the top 1024
  ids but the codec eos suppressed), then its code predictor (transformers' own `generate`,
  greedy) the residual codebooks from the step's last hidden state; the next step is fed the
  sum of the code's embeddings and the next reply token's projected embedding (then the TTS
  eos, then its pad). A code goes out, all its codebooks, once its residuals are drawn; as in
  the reference, the code of the last step a budget allows is not (its residuals never are).
- code2wav: the causal Code2Wav decoder as a stream (code2wav.py, streaming.py): each code
  decoded once, from what the codes before it left, 1920 samples a code at 24 kHz; a decode's
  last 555 samples wait for the next code (its causal transposed convolutions' overhang), so
  every sample out is the whole decode's. The first audio after one code (`firstChunkCodes`:
  its first 1365 samples are final), more codes when the replica is busy
  (`busyFirstChunkCodes`; docs/models.md, First audio), then `chunkCodes` at a
  time (25 by default).

The voice (`audio.voice`: the checkpoint's `speaker_id` names, Ethan by default as in the
reference) picks the talker's speaker code.
"""
