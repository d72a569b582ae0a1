"""Sound in training records: audio clips read, checked, resampled, converted, and laid out beside the token ids.

A record with sound carries its clips' paths (Record.audios) and one `<audio>` placeholder in its text where each
goes, in order, as pictures do (images.py). Two forms are read:

- LLaMA-Factory's: `<audio>` placeholders written in the text of any format (chat, ShareGPT, Alpaca...), and an
  `audios` list of files;
- content parts: a message's `content` is a list of parts, `{"type": "audio", "path": ...}` (or `"audio": ...`) and
  `{"type": "text", "text": ...}`; the parts' paths are the record's clips, in order.

Paths are relative to the data file. Each clip is opened with soundfile (WAV, FLAC, OGG...) when the record is read,
so a missing or unreadable one stops the run with its line before anything is written. A clip is mixed down to one
channel and resampled to the rate the preset's converter takes (16 kHz) with scipy's polyphase filter; keras-hub's
audio converter of the preset (Gemma4AudioConverter) makes its log-mel frames when the rows are made. Each
placeholder becomes the family's audio tokens, as keras-hub's preprocessor writes them: Gemma 4 gives a clip one
soft token per 4 mel frames of it (25 a second), so a clip's tokens follow its length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune.platform.errors import UserError

PLACEHOLDER = "<audio>"
# The model inputs beside the tokens: each clip's log-mel frames and which of them hold sound (Gemma 4's audio_mel
# and audio_mel_mask, Gemma 3n's input_features and input_features_mask), and where its soft tokens sit, per row;
# audio_mask is per position. Gemma 3n places its clips by their order in the batch (images.in_batch_order).
PER_ROW = ("audio_mel", "audio_mel_mask", "audio_indices", "input_features", "input_features_mask")
INPUTS = (*PER_ROW, "audio_mask")


@dataclass(frozen=True)
class Hearing:
    """What a preset's preprocessor says of its audio clips."""

    rate: int
    """Samples a second the converter takes (16,000)."""
    stride: int
    """Samples a mel frame advances by (160: 100 frames a second)."""
    longest: float
    """Seconds of a clip the converter keeps (Gemma 4's max_audio_length, Gemma 3n's 30; the rest it cuts)."""
    max_clips: int
    """Clips a record may hold (keras-hub's max_audio_clips_per_prompt, max_audios_per_prompt)."""
    placeholder_id: int
    """The id of the soft token, whose positions the clip's embeddings take."""
    soft: str
    """The soft token."""
    marker: str
    """The token keras-hub's generate() expands into a clip's tokens (Gemma 4's soft token, Gemma 3n's start)."""
    start: str
    end: str
    """What stands on each side of a clip's soft tokens."""
    margin: str
    """What stands outside them (Gemma 3n: a blank line either side)."""
    per_clip: int | None
    """The soft tokens of every clip, where the family fixes them (Gemma 3n: 188); None: they follow its length."""
    names: tuple
    """The model's inputs of a clip's frames and of which frames hold it."""
    prompt_key: str
    """What keras-hub's generate() takes the clips as."""
    converter: object
    """keras-hub's audio converter of the preset."""

    def tokens(self, samples: int) -> int:
        """Soft tokens a clip of `samples` (at `rate`) becomes: Gemma 3n's fixed count, or one per 4 of its mel
        frames, rounded up, as keras-hub's Gemma4CausalLMPreprocessor counts them."""
        if self.per_clip is not None:
            return self.per_clip
        frames = min(samples, int(self.longest * self.rate)) // self.stride
        return max(1, (frames + 3) // 4)

    def expansion(self, samples: int) -> str:
        return f"{self.margin}{self.start}{self.soft * self.tokens(samples)}{self.end}{self.margin}"

    def converted(self, sound: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(frames, mels) float32 and (frames,) int32, 1 on the frames that hold the clip, as keras-hub's
        preprocessor makes them: Gemma 4's padded to its converter's whole length, Gemma 3n's the clip's own."""
        import keras

        if self.per_clip is not None:
            features, mask = self.converter(sound[None], padding="longest")
            return _numpy(features)[0].astype(np.float32), _numpy(mask)[0].astype(np.int32)
        mel = np.asarray(keras.ops.convert_to_numpy(self.converter(sound[None])))[0]
        mask = np.zeros(len(mel), np.int32)
        mask[: min(len(sound), len(mel) * self.stride) // self.stride] = 1
        return mel.astype(np.float32), mask


def _numpy(value) -> np.ndarray:
    import keras

    return np.asarray(keras.ops.convert_to_numpy(value))


def hearing_of(preprocessor) -> Hearing | None:
    """The preprocessor's audio handling; None for one without an audio converter."""
    converter = getattr(preprocessor, "audio_converter", None)
    tokenizer = getattr(preprocessor, "tokenizer", None)
    if converter is None or getattr(tokenizer, "audio_placeholder", None) is None:
        return None
    soft, start, end = tokenizer.audio_placeholder, tokenizer.start_of_audio_token, tokenizer.end_of_audio_token
    if hasattr(preprocessor, "num_audio_tokens_per_audio"):  # Gemma 3n: a fixed count, laid out as its pictures
        return Hearing(int(converter.sampling_rate), int(converter.hop_length), GEMMA3N_LONGEST,
                       int(preprocessor.max_audios_per_prompt), tokenizer.token_to_id(soft), soft, start, start, end,
                       "\n\n", int(preprocessor.num_audio_tokens_per_audio), ("input_features", "input_features_mask"),
                       "audios", converter)  # fmt: skip
    return Hearing(int(converter.sampling_rate), int(converter.stride), float(converter.max_audio_length),
                   int(preprocessor.max_audio_clips_per_prompt), tokenizer.token_to_id(soft), soft, soft, start, end,
                   "", None, ("audio_mel", "audio_mel_mask"), "audio", converter)  # fmt: skip


# Gemma 3n's converter cuts a clip at 480,000 samples (its call's max_length): 30 s at 16 kHz.
GEMMA3N_LONGEST = 30.0


def part_text(part: dict) -> str | None:
    """A content part's text if it is an audio part (its placeholder), else None."""
    return PLACEHOLDER if part.get("type") == "audio" else None


def part_paths(messages) -> list[str]:
    """The paths of the audio content parts of a chat record's messages, in order."""
    found = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "audio":
                found.append(part.get("path", part.get("audio")))
    return found


def audio_paths(obj: dict, where: str, source: str) -> tuple[str, ...]:
    """The record's clips, its `audios` list or its audio content parts' paths, resolved against the data file's
    folder and each checked with soundfile."""
    listed, parts = obj.get("audios"), part_paths(obj.get("messages"))
    if listed is not None and parts:
        raise UserError(f"{where}: the record gives its audio both in `audios` and in content parts; give it in one")
    listed = parts or listed
    if listed is None:
        return ()
    if not isinstance(listed, list) or not all(isinstance(p, str) and p.strip() for p in listed):
        raise UserError(f"{where}: `audios` must be a list of audio file paths (relative to the data file)")
    folder = Path(source).expanduser().parent
    return tuple(str(check(folder / p, where)) for p in listed)


def check(path: Path, where: str, hint: str = "; paths are relative to the data file") -> Path:
    """`path` if soundfile reads it as audio with at least one sample."""
    import soundfile

    if not path.is_file():
        raise UserError(f"{where}: audio {path} does not exist{hint}")
    try:
        info = soundfile.info(str(path))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        said = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        raise UserError(f"{where}: {path} is not audio soundfile reads (WAV, FLAC, OGG...): {said}") from None
    if info.frames == 0:
        raise UserError(f"{where}: audio {path} holds no samples")
    return path.resolve()


def samples(path, rate: int) -> np.ndarray:
    """The clip's samples, float32 in [-1, 1], mixed down to one channel and resampled to `rate`."""
    import soundfile

    sound, own = soundfile.read(str(path), dtype="float32", always_2d=True)
    sound = sound.mean(axis=1)
    if own == rate:
        return sound
    try:
        from scipy import signal
    except ImportError:
        raise UserError(
            f"audio {path} is sampled at {own} Hz and the preset takes {rate} Hz; resampling needs scipy "
            f"(pip install scipy), or give the clip at {rate} Hz"
        ) from None
    common = math.gcd(int(own), rate)
    return signal.resample_poly(sound, rate // common, int(own) // common).astype(np.float32)


def length(path, rate: int) -> int:
    """How many samples the clip has at `rate`, from its header (resample_poly's output length)."""
    import soundfile

    info = soundfile.info(str(path))
    common = math.gcd(int(info.samplerate), rate)
    return -(-info.frames * (rate // common) // (int(info.samplerate) // common))


def limit(records, hearing: Hearing, source: str) -> None:
    """Refuse a record with more clips than the family takes, or a clip longer than its converter keeps."""
    most = max((len(r.audios) for r in records), default=0)
    if most > hearing.max_clips:
        raise UserError(
            f"a record of {source} holds {most} audio clips; this preset takes at most {hearing.max_clips} per record"
        )
    for record in records:
        for path in record.audios:
            seconds = length(path, hearing.rate) / hearing.rate
            if seconds > hearing.longest:
                raise UserError(f"audio {path} is {seconds:.1f} s long; this preset hears at most "
                                f"{hearing.longest:g} s a clip: cut it into shorter clips")  # fmt: skip


def expand(segments, hearing: Hearing, clips) -> list:
    """A template's (text, trained) segments with each placeholder written as its clip's audio tokens, in order."""
    expansions = iter([hearing.expansion(length(path, hearing.rate)) for path in clips])
    written = []
    for text, trained in segments:
        pieces = text.split(PLACEHOLDER)
        text = pieces[0] + "".join(next(expansions) + piece for piece in pieces[1:])
        written.append((text, trained))
    return written


def most_tokens(records, hearing: Hearing) -> int:
    """The most soft tokens a clip of these records takes: every row's room per clip slot."""
    counts = [hearing.tokens(length(path, hearing.rate)) for record in records for path in record.audios]
    return max(counts, default=0)


def most_frames(records, hearing: Hearing) -> int:
    """The most frames a clip of these records takes: every slot's room (Gemma 4: its converter's whole length)."""
    if hearing.per_clip is None:
        return int(hearing.longest * hearing.rate) // hearing.stride
    return max((len(hearing.converted(samples(path, hearing.rate))[1]) for r in records for path in r.audios),
               default=0)  # fmt: skip


def frames(clips, hearing: Hearing, slots: int, count: int) -> dict:
    """The converter's log-mel frames of `slots` clip slots of `count` frames, each clip's then empty ones: its
    frames (slots, count, mels) float32, and (slots, count) int32: 1 on the frames that hold the clip (Gemma 4's
    audio_mel_mask), or on those that do not (Gemma 3n's input_features_mask, which keras-hub's preprocessor
    inverts as transformers' model does)."""
    mels = int(getattr(hearing.converter, "num_mels", getattr(hearing.converter, "feature_size", 0)))
    padding = int(hearing.per_clip is not None)
    mel = np.zeros((slots, count, mels), np.float32)
    mask = np.full((slots, count), padding, np.int32)
    for slot, path in enumerate(clips[:slots]):
        converted, held = hearing.converted(samples(path, hearing.rate))
        mel[slot, : len(converted)] = converted[:count]
        mask[slot, : len(held)] = np.abs(held[:count] - padding)
    features, held = hearing.names
    return {features: mel, held: mask}


def model_inputs(clips, token_ids, hearing: Hearing, slots: int, room: tuple, source: str = "") -> dict:
    """One example's audio inputs: its clips' frames (frames()), and `audio_indices` (slots x per_clip), each clip's
    soft-token positions at its slot's start, then 0 (a position keras-hub's model restores).

    room: (the soft tokens, the frames) of the longest clip of the data (most_tokens(), most_frames()).
    """
    per_clip, frame_count = room
    inputs = np.asarray(token_ids[:-1])
    positions = np.flatnonzero(inputs == hearing.placeholder_id).astype(np.int32)
    counts = [hearing.tokens(length(path, hearing.rate)) for path in clips]
    if len(positions) != sum(counts):
        raise UserError(
            f"a record of {source or 'the data'} with {len(clips)} audio clip(s) is cut inside its audio tokens "
            f"({sum(counts)}) by the sequence length; raise --seq-len or shorten the prompt"
        )
    indices = np.zeros(slots * per_clip, np.int32)
    for slot, (start, count) in enumerate(zip(np.cumsum([0, *counts[:-1]]), counts)):
        indices[slot * per_clip : slot * per_clip + count] = positions[start : start + count]
    return {**frames(clips, hearing, slots, frame_count), "audio_indices": indices}


def attached(example, record, hearing: Hearing, slots: int, room: tuple, source: str = ""):
    """The example with its audio inputs, and weight 0 on its soft tokens: a clip is never a target."""
    heard = model_inputs(record.audios, example.token_ids, hearing, slots, room, source)
    example.inputs = {**example.inputs, **heard}
    soft = np.asarray(example.token_ids) == hearing.placeholder_id
    example.weights = [0.0 if is_soft else weight for weight, is_soft in zip(example.weights, soft)]
    return example


def generation_input(prompts: list[str], clips: list, hearing: Hearing) -> dict:
    """keras-hub's generate() input for prompts that each hear a clip (`clips`, one path a prompt): its `<audio>`
    written as the family's marker, which keras-hub's preprocessor expands as training did, and the clip's samples
    at the converter's rate, cut to what the converter keeps."""
    sounds = [samples(clip, hearing.rate)[: int(hearing.longest * hearing.rate)] for clip in clips]
    return {"prompts": [p.replace(PLACEHOLDER, hearing.marker) for p in prompts], hearing.prompt_key: sounds}


def with_placeholder(prompt: str) -> str:
    """A prompt given one clip: as it is where it places it with `<audio>`, else with it before it."""
    found = prompt.count(PLACEHOLDER)
    if found == 0:
        return PLACEHOLDER + prompt
    if found != 1:
        raise UserError(f"the prompt has {found} {PLACEHOLDER} placeholders and one --audio; give one")
    return prompt


def written_prompt(prompt: str, hearing: Hearing, samples: int) -> str:
    """A generation_input() prompt as the model reads it, its clip of `samples` written out as its tokens."""
    return prompt.replace(hearing.marker, hearing.expansion(samples))
