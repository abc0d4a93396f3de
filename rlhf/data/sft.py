"""Supervised examples: rows → token ids with a loss mask on response tokens; truncation; packing.

A row is either a conversation (``data.messages_key``: a list of {role, content}; every assistant
turn is trained on; ``data.tools_key``, if the row has it, the tools' JSON schemas the template renders) or a prompt/response pair (``data.prompt_key`` / ``data.response_key``).

    data.chat_template=true    render with ``tokenizer.apply_chat_template`` (prompt/response rows
                               become one user turn and one assistant turn); a tokenizer without a
                               template is an error that says so
    data.chat_template=false   raw text: ``tokenize(prompt)`` (with the tokenizer's special tokens)
                               followed by ``tokenize(response) + [eos]`` — the same token boundary
                               the RL rollout has (prompt ids, then generated ids), so an SFT model
                               is a good start for RL on the same prompts

Truncation (``data.truncation``) to ``max_length`` tokens: ``right`` keeps the first tokens,
``left`` the last ones, ``drop`` skips the example; an example left without any trained token is
dropped too. ``TruncationReport`` counts what happened, and the loops print and log it.

Packing (``algo.packing``) concatenates examples into rows of up to ``max_length`` tokens (first
fit, longest first); ``position_ids`` restart at every example and ``model_inputs`` builds a
block-diagonal causal mask, so packed examples never attend to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import torch

from rlhf.data.files import Records, check_messages, row_value
from rlhf.spec.errors import UserError
from rlhf.spec.schema import DataSpec

TRUNCATION = ("right", "left", "drop")
T = TypeVar("T")


# ----------------------------------------------------------------------------- reports


@dataclass
class TruncationReport:
    """What tokenisation did to a data set (printed once, logged as metrics)."""

    what: str  # "sft train", "preference eval", ...
    max_length: int
    policy: str
    total: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens_cut: int = 0
    longest: int = 0

    def line(self) -> str:
        kept = self.total - self.dropped
        s = f"{self.what}: {kept}/{self.total} examples kept (max_length {self.max_length}, longest {self.longest})"
        if self.truncated:
            s += f"; {self.truncated} truncated ({self.policy}, {self.tokens_cut} tokens cut)"
        if self.dropped:
            s += f"; {self.dropped} dropped"
        if self.truncated or self.dropped:
            s += ". Raise data.max_length to keep more."
        return s

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/examples": float(self.total - self.dropped),
            f"{prefix}/truncated": float(self.truncated),
            f"{prefix}/dropped": float(self.dropped),
        }


# ----------------------------------------------------------------------------- rendering


def require_template(tokenizer: Any, model_path: str = "the model") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"data.chat_template=true (or the data has conversations) but the tokenizer of {model_path} has no "
            "chat template. Use a chat model's tokenizer, add a chat_template to its tokenizer_config.json "
            "(or chat_template.jinja), or set data.chat_template=false with prompt/response text rows."
        )


def encode_text(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _render(tokenizer: Any, messages: list[dict], *, gen_prompt: bool, tools: Optional[list] = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=gen_prompt)


def conversation_segments(tokenizer: Any, messages: list[dict], where: str,
                          tools: Optional[list] = None) -> list[tuple[str, bool]]:
    """Chat-template text of a conversation split into (text, trained) pieces: every assistant
    turn (what the template adds after the generation prompt) is trained, the rest is not.
    ``tools``: the JSON schemas the template renders (a row's ``data.tools_key``), as an agent
    rollout's prompt has them."""
    full = _render(tokenizer, messages, gen_prompt=False, tools=tools)
    pieces: list[tuple[str, bool]] = []
    done = 0  # characters of `full` already assigned
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], gen_prompt=True, tools=tools) if i else ""
        upto = _render(tokenizer, messages[: i + 1], gen_prompt=False, tools=tools)
        if not full.startswith(before) or not full.startswith(upto) or len(before) < done:
            raise UserError(
                f"{where}: the chat template does not render this conversation as a growing prefix, so the "
                "assistant turns cannot be located. Use prompt/response rows, or a template without history rewriting."
            )
        if len(before) > done:
            pieces.append((full[done : len(before)], False))
        pieces.append((full[len(before) : len(upto)], True))
        done = len(upto)
    if not any(t for _, t in pieces):
        raise UserError(f"{where}: the conversation has no assistant turn to train on.")
    if done < len(full):
        pieces.append((full[done:], False))
    return pieces


def encode_segments(tokenizer: Any, pieces: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        t = encode_text(tokenizer, text, special=False)  # the template already wrote special tokens
        ids.extend(t)
        mask.extend([1 if trained else 0] * len(t))
    return ids, mask


def eos_id(tokenizer: Any) -> Optional[int]:
    return getattr(tokenizer, "eos_token_id", None)


def prompt_ids(tokenizer: Any, prompt: Any, *, chat_template: bool, where: str) -> list[int]:
    """Token ids of a prompt as the RL rollout would feed it (string, or messages with a template)."""
    if isinstance(prompt, list):
        require_template(tokenizer)
        check_messages(prompt, where=where)
        return encode_text(tokenizer, _render(tokenizer, prompt, gen_prompt=True), special=False)
    if chat_template:
        require_template(tokenizer)
        text = _render(tokenizer, [{"role": "user", "content": prompt}], gen_prompt=True)
        return encode_text(tokenizer, text, special=False)
    return encode_text(tokenizer, prompt, special=True)


def response_ids(tokenizer: Any, prompt: Any, response: Any, *, chat_template: bool, where: str) -> list[int]:
    """Token ids of a response to follow ``prompt_ids`` of the same prompt (ends with eos / end of turn)."""
    if isinstance(response, list) or isinstance(prompt, list) or chat_template:
        require_template(tokenizer)
        p_msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        r_msgs = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        check_messages(r_msgs, where=where)
        before = _render(tokenizer, p_msgs, gen_prompt=True)
        full = _render(tokenizer, p_msgs + r_msgs, gen_prompt=False)
        if not full.startswith(before):
            raise UserError(f"{where}: the chat template does not render prompt + response as prompt followed by a reply.")
        return encode_text(tokenizer, full[len(before):], special=False)
    ids = encode_text(tokenizer, response, special=False)
    e = eos_id(tokenizer)
    if e is not None and (not ids or ids[-1] != e):
        ids.append(e)
    return ids


# ----------------------------------------------------------------------------- SFT examples


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens trained on (predicted from the tokens before them)


def sft_example(rec: Records, i: int, tokenizer: Any, data: DataSpec) -> Example:
    row = rec.rows[i]
    where = rec.where(i)
    if data.messages_key in row and isinstance(row[data.messages_key], list):
        msgs = row_value(rec, i, data.messages_key, spec_key="messages_key", kinds=("messages",))
        require_template(tokenizer)
        tools = row.get(data.tools_key)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise UserError(f"{where}: {data.tools_key!r} should be a list of tool JSON schemas (what the chat "
                            f"template renders), got {str(tools)[:80]}. Fix the column or set data.tools_key.")
        ids, mask = encode_segments(tokenizer, conversation_segments(tokenizer, msgs, where, tools))
        return Example(ids, mask)
    if data.prompt_key not in row and data.messages_key not in row:
        raise UserError(
            f"{where}: neither a conversation ({data.messages_key!r}) nor a prompt ({data.prompt_key!r}) "
            f"(keys: {', '.join(map(str, row))}). Set data.messages_key or data.prompt_key/data.response_key."
        )
    prompt = row_value(rec, i, data.prompt_key, spec_key="prompt_key", kinds=("text", "messages"))
    response = row_value(rec, i, data.response_key, spec_key="response_key", kinds=("text", "messages"))
    p = prompt_ids(tokenizer, prompt, chat_template=data.chat_template, where=where)
    r = response_ids(tokenizer, prompt, response, chat_template=data.chat_template, where=where)
    return Example(p + r, [0] * len(p) + [1] * len(r))


def truncate(ex: Example, max_length: int, policy: str) -> tuple[Optional[Example], int]:
    """(example or None when dropped, tokens cut)."""
    n = len(ex.input_ids)
    if n <= max_length:
        return ex, 0
    if policy == "drop":
        return None, n
    sl = slice(0, max_length) if policy == "right" else slice(n - max_length, n)
    out = Example(ex.input_ids[sl], ex.loss_mask[sl])
    if not any(out.loss_mask[1:]):  # nothing left to predict
        return None, n
    return out, n - max_length


def truncation_policy(data: DataSpec) -> str:
    """``data.truncation``, checked."""
    policy = getattr(data, "truncation", "right")
    if policy not in TRUNCATION:
        raise UserError(f"data.truncation={policy!r} is not a policy. Use one of: {', '.join(TRUNCATION)}.")
    return policy


def keep_within(items: Iterable[T], length: Callable[[T], int], cut: Callable[[T], tuple[Optional[T], int]],
                report: TruncationReport, unit: str) -> list[T]:
    """``cut`` applied to every item (``(kept or None, tokens cut)``), counted in ``report``; a data
    set that loses every item is an error naming the fix."""
    out = []
    for item in items:
        report.total += 1
        report.longest = max(report.longest, length(item))
        kept, n_cut = cut(item)
        if kept is None:
            report.dropped += 1
            continue
        if n_cut:
            report.truncated += 1
            report.tokens_cut += n_cut
        out.append(kept)
    if not out:
        raise UserError(f"{report.what}: every {unit} was dropped by truncation ({report.line()}). Raise data.max_length.")
    return out


def build_sft(rec: Records, tokenizer: Any, data: DataSpec, max_length: int, what: str = "sft") -> tuple[list[Example], TruncationReport]:
    policy = truncation_policy(data)
    report = TruncationReport(what=what, max_length=max_length, policy=policy)

    def examples():
        for i in range(len(rec)):
            ex = sft_example(rec, i, tokenizer, data)
            if not any(ex.loss_mask[1:]):
                raise UserError(f"{rec.where(i)}: the response is empty after tokenisation; nothing to train on.")
            yield ex

    out = keep_within(examples(), lambda ex: len(ex.input_ids), lambda ex: truncate(ex, max_length, policy),
                      report, "example")
    return out, report


# ----------------------------------------------------------------------------- packing / batches


@dataclass
class Row:
    """One training row: one example, or several packed ones (``seg`` numbers them from 0)."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 0 at every example's first token
    position_ids: list[int] = field(default_factory=list)
    seg: list[int] = field(default_factory=list)

    def add(self, ids: Sequence[int], mask: Sequence[int], seg: int) -> None:
        self.input_ids.extend(ids)
        self.loss_mask.extend([0, *mask[1:]] if len(mask) else [])  # an example's first token has no context
        self.position_ids.extend(range(len(ids)))
        self.seg.extend([seg] * len(ids))

    def __len__(self) -> int:
        return len(self.input_ids)


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices (each bin's total length <= capacity), first fit by decreasing length."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    for b in bins:
        b.sort()
    return bins


def to_rows(examples: Sequence[Example], *, pack: bool, max_length: int) -> list[Row]:
    if not pack:
        rows = []
        for ex in examples:
            r = Row()
            r.add(ex.input_ids, ex.loss_mask, 0)
            rows.append(r)
        return rows
    rows = []
    for b in first_fit([len(e.input_ids) for e in examples], max_length):
        r = Row()
        for k, i in enumerate(b):
            r.add(examples[i].input_ids, examples[i].loss_mask, k)
        rows.append(r)
    return rows


def collate(rows: Sequence[Row], pad_id: int) -> dict[str, Any]:
    """Right-padded tensors: input_ids, loss_mask, position_ids, seg (-1 on padding), the real
    tokens' places (``padding_free_index``) and the trained ones' (``scored_index`` of loss_mask)."""
    T = max(len(r) for r in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    pos = torch.zeros((B, T), dtype=torch.long)
    seg = torch.full((B, T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r)
        ids[b, :n] = torch.tensor(r.input_ids)
        mask[b, :n] = torch.tensor(r.loss_mask)
        pos[b, :n] = torch.tensor(r.position_ids)
        seg[b, :n] = torch.tensor(r.seg)
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos, "seg": seg, **padding_free_index(seg, pos),
            "scored_index": scored_index(mask)}


def scored_index(keep: torch.Tensor) -> torch.Tensor:
    """The flat positions ``[N]`` in the ``[B * T]`` layout, row by row, of the tokens whose
    log-probs a supervised objective takes (``keep [B, T]``, without each row's position 0, which
    nothing predicts). Found here on the host: ``rlhf.algos.offline.token_logps`` selects and
    scatters with them, where a boolean mask would make the device report its count to the host."""
    keep = keep.to(torch.bool).clone()
    keep[:, 0] = False
    return torch.nonzero(keep.flatten()).flatten()


def padding_free_index(seg: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
    """Where the real tokens of right-padded rows sit, for the padding-free pass of the supervised
    objectives (``rlhf.algos.offline.backbone_hidden``), found here on the host so that the
    worker's pass reads no device value back: ``real_index [N]`` their flat positions in the
    ``[B * T]`` layout, row by row; ``cu_seqlens [n + 1]`` (int32) where each example starts among
    them (at its position id 0) and where the last ends; ``max_len`` the longest example, an int."""
    real = torch.nonzero(seg.flatten() >= 0).flatten()
    starts = torch.nonzero(position_ids.flatten()[real] == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([real.numel()])])
    return {"real_index": real, "cu_seqlens": cu.to(torch.int32), "max_len": int((cu[1:] - cu[:-1]).max())}


def model_inputs(batch: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32, attn_impl: str = "sdpa") -> dict[str, torch.Tensor]:
    """Keyword arguments for a HF model's forward.

    Rows with one example each get a plain 2-D padding mask. Packed rows get restarting
    ``position_ids`` and, unless the attention kernel is flash-attention (which finds the example
    boundaries from ``position_ids`` itself), an additive 4-D block-diagonal causal mask.
    """
    ids, seg, pos = batch["input_ids"], batch["seg"], batch["position_ids"]
    packed = bool((seg > 0).any())
    if not packed:
        return {"input_ids": ids, "attention_mask": (seg >= 0).long(), "position_ids": pos}
    if "flash" in (attn_impl or ""):
        return {"input_ids": ids, "position_ids": pos}
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    allowed = same & causal
    # padding rows attend to themselves only, so no softmax row is empty
    allowed |= torch.eye(T, dtype=torch.bool, device=ids.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return {"input_ids": ids, "attention_mask": mask[:, None], "position_ids": pos}
