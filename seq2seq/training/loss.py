"""Label-smoothed cross-entropy: per token (validation), and fused with the output projection (training).

With smoothing ε over a vocabulary of V tokens, the loss at one position with logits z and target y is

    (1 - ε) * NLL + ε * mean_v(-log p_v),    NLL = logsumexp(z) - z_y,    mean_v(-log p_v) = logsumexp(z) - mean(z)

which is what F.cross_entropy(label_smoothing=ε) computes, and its gradient with respect to z is
softmax(z) - (1 - ε) * onehot(y) - ε / V.

Why a fused training loss: the (tokens, V) logits of a Multi30k batch are 4k x 8k floats (130 MB).
Computed whole, the projection, log-softmax, its backward and the gather/mean backward each write
such a tensor; on a CPU those passes (and the page faults of allocating them) are a large share of a
training step (bench/train_ablation.py measures what fusing gains; docs/results/training-speed.md has the figures).
`linear_label_smoothed_nll` instead walks the tokens in chunks small enough to stay in cache, computes each chunk's logits, loss and gradient at once, and keeps only the (tokens, D)
and (V, D) gradients (the idea of Liger-Kernel's fused linear cross-entropy). No FLOPs are added:
the two gradient matmuls move from the backward pass into the forward pass.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq.model import Transformer
from seq2seq.model.numerics import exp_

HiddenStates = Callable[[Tensor, Tensor], Tensor]  # (src (B, S), tgt_in (B, T)) -> (B, T, D), as model.hidden_states

# Rows per chunk, as logits per chunk. CPU: 4M floats (16 MB in fp32) fit the L3 cache; at Multi30k
# sizes a few hundred to a thousand rows per chunk run alike and far fewer run slower (small matmuls). GPUs have no such
# cache to fit and want large matmuls: 64M floats (256 MB), ~2k rows of a 32k vocabulary.
CPU_CHUNK_ELEMENTS = 2**22
GPU_CHUNK_ELEMENTS = 2**26


def label_smoothed_nll(logits: Tensor, target: Tensor, *, smoothing: float, pad_id: int) -> tuple[Tensor, Tensor]:
    """Per-token (label-smoothed loss, NLL), zero at pad targets; logits (..., V), target (...)."""
    # At least float32: a bf16 log-softmax over a large vocabulary loses the small probabilities.
    log_probs = F.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (..., V)
    is_pad = target == pad_id
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1).masked_fill(is_pad, 0.0)  # (...)
    # Smoothing spreads `smoothing` mass uniformly over the vocabulary, as F.cross_entropy does.
    uniform = -log_probs.mean(dim=-1).masked_fill(is_pad, 0.0)
    return (1 - smoothing) * nll + smoothing * uniform, nll


def training_loss(
    model: Transformer, *, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, smoothing: float,
    hidden_states: HiddenStates | None = None, target_positions: Tensor | None = None, rdrop_alpha: float = 0.0,
) -> tuple[Tensor, Tensor, int]:
    """One teacher-forced batch: summed (label-smoothed loss, NLL) over its target tokens, and their count.

    Only the non-pad positions are projected to the vocabulary, fused with the loss. `hidden_states`: the
    model's own, compiled (training/compiled.py); model.hidden_states by default. `target_positions` (N,): where
    the real target tokens are in tgt_out.flatten() (the batch's, from collate): given, the step never waits on
    the device to count them; else found from tgt_out here. The same rows either way, in the same order.

    `rdrop_alpha` > 0: R-Drop. The batch goes through the model twice (as one batch of twice the rows, each copy
    with its own dropout masks) and the loss is both passes' plus alpha/2 times their symmetric KL divergence
    (linear_rdrop_loss); the NLL is both passes' and the count is 2N, so loss / count is per position trained.
    """
    positions = tgt_out.numel()
    if rdrop_alpha > 0:  # rows b and B + b: one sentence pair, two passes
        src, tgt_in, tgt_out = torch.cat((src, src)), torch.cat((tgt_in, tgt_in)), torch.cat((tgt_out, tgt_out))
    hidden = (hidden_states or model.hidden_states)(src, tgt_in)  # (B, T, D), or (2B, T, D)
    if target_positions is None:
        target_positions = (tgt_out[: tgt_out.size(0) // 2] if rdrop_alpha > 0 else tgt_out)
        target_positions = (target_positions != model.config.pad_id).flatten().nonzero().squeeze(1)  # (N,)
    if rdrop_alpha > 0:
        both = torch.cat((target_positions, target_positions + positions))  # (2N,): the first pass's, the second's
        loss, nll = linear_rdrop_loss(
            hidden.flatten(0, 1).index_select(0, both), model.output_projection.weight,
            tgt_out.flatten().index_select(0, target_positions), bias=model.output_projection.bias,
            smoothing=smoothing, alpha=rdrop_alpha,
        )
        return loss, nll, 2 * target_positions.numel()
    loss, nll = linear_label_smoothed_nll(
        hidden.flatten(0, 1).index_select(0, target_positions), model.output_projection.weight,
        tgt_out.flatten().index_select(0, target_positions), bias=model.output_projection.bias, smoothing=smoothing,
    )
    return loss, nll, target_positions.numel()


def linear_label_smoothed_nll(
    hidden: Tensor, weight: Tensor, target: Tensor, *, bias: Tensor | None = None, smoothing: float,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Summed (label-smoothed loss, NLL) of the logits `hidden @ weight.T + bias`, never held whole.

    hidden: (N, D) decoder states at real (non-pad) target positions; weight: (V, D) output
    projection; bias: (V,) or None; target: (N,) ids. The bias is added in float32. Returns two scalars; only the loss is differentiable (the NLL is
    for logging). Under autocast the matmuls run in the autocast dtype and the softmax in float32.
    """
    if chunk_rows is None:
        chunk_elements = CPU_CHUNK_ELEMENTS if hidden.device.type == "cpu" else GPU_CHUNK_ELEMENTS
        chunk_rows = max(1, chunk_elements // weight.size(0))
    return _LinearLabelSmoothedNLL.apply(hidden, weight, bias, target, smoothing, chunk_rows)


class _LinearLabelSmoothedNLL(torch.autograd.Function):
    """The chunked loss and its gradients, computed in forward; backward scales them by the upstream gradient.

    Per chunk of n rows, with numerators e = exp(z - peak) (n, V), their row sums s and r = 1 / s, the gradient
    with respect to the logits is G = r * e' - ε / V, where e' is e with (1 - ε) * s taken off at each row's target
    (one entry a row, computed in float32 from the target's logit). So neither G nor the softmax is ever written
    out: the rows' scale r goes onto the (n, D) side of each gradient matmul, and the uniform ε / V term is a
    rank-one correction in float32 (through the weight's column mean and the hidden states' sum), as is the
    logits' mean that smoothing needs. The (n, V) passes left: the three matmuls, the exp with its peak and sum,
    and under autocast the logits' casts to float32 and back.

    The weight's gradient is accumulated transposed, (D, V) += (r * h)^T @ e': both matmul operands are then
    row-major (oneDNN runs a bf16 GEMM whose left operand is transposed, G^T @ h, well below its rate: it copies
    that operand into its own layout first; docs/results/training-speed.md#bf16-2026-12-03); one more row of r gives
    the bias's gradient in the same matmul.

    Under autocast the matmuls run in the autocast dtype and the softmax in float32 (on a CPU, bf16's exp,
    sum and max run slower than float32's, and a bf16 log-softmax would lose the small probabilities).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, smoothing: float,
                chunk_rows: int):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        acc_dtype = torch.promote_types(dtype, torch.float32)  # the softmax, the loss, the gradients
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        rows, d_model = hidden.shape
        vocab = weight.size(0)
        uniform = smoothing / vocab
        with torch.autocast(device, enabled=False):
            hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)
            hidden32 = hidden_c.to(acc_dtype)  # (N, D): the rows the matmuls see, for the float32 side
            bias_c = bias.to(acc_dtype) if bias is not None else None  # (V,), added in float32
            # mean_v(z) = h . mean_v(W) + mean(b), in float32, without a pass over the logits
            weight_mean = weight.to(acc_dtype).mean(dim=0)  # (D,)
            bias_mean = bias.to(acc_dtype).mean() if bias is not None else 0.0
            loss_sum = hidden.new_zeros((), dtype=acc_dtype)
            nll_sum = hidden.new_zeros((), dtype=acc_dtype)
            grad_hidden = hidden.new_empty((rows, d_model), dtype=acc_dtype) if needs_grad else None  # (N, D)
            # (D + 1, V): the weight's gradient transposed, then the bias's; the uniform term's share to start with
            grad_weight_t = None
            if needs_grad:
                grad_weight_t = torch.empty((d_model + 1, vocab), dtype=acc_dtype, device=hidden.device)
                grad_weight_t[:d_model] = (-uniform * hidden32.sum(dim=0))[:, None]
                grad_weight_t[d_model] = -uniform * rows
            for start in range(0, rows, chunk_rows):
                h, y = hidden_c[start : start + chunk_rows], target[start : start + chunk_rows]  # (n, D), (n,)
                logits = (h @ weight_c.T).to(acc_dtype)  # (n, V)
                if bias_c is not None:
                    logits += bias_c
                peak = logits.amax(dim=-1)  # (n,)
                target_logit = logits.gather(-1, y[:, None]).squeeze(-1)  # (n,)
                h32 = hidden32[start : start + chunk_rows]  # (n, D)
                mean_logit = h32 @ weight_mean + bias_mean  # (n,)
                # exp(logits - peak), in place: the softmax's numerators (exp_ avoids a slow path)
                numerators = exp_(logits.sub_(peak[:, None]))
                total = numerators.sum(dim=-1, dtype=acc_dtype)  # (n,)
                lse = total.log() + peak
                nll = lse - target_logit
                loss_sum += ((1 - smoothing) * nll + smoothing * (lse - mean_logit)).sum()
                nll_sum += nll.sum()
                if grad_hidden is None or grad_weight_t is None:  # no gradient wanted
                    continue
                # e' at the targets: exp(z_y - peak) - (1 - ε) s, from the float32 logit (no cancellation in bf16)
                at_target = exp_(target_logit - peak) - (1 - smoothing) * total
                numerators.scatter_(-1, y[:, None], at_target[:, None])
                numerators = numerators.to(dtype)
                scale = total.reciprocal()[:, None]  # (n, 1)
                grad_hidden[start : start + chunk_rows] = (numerators @ weight_c).to(acc_dtype).mul_(scale)
                # (D + 1, n), row-major: the rows' scale on the small side, and once more for the bias
                scaled_t = torch.cat((h32 * scale, scale), dim=1).T.contiguous().to(dtype)
                if dtype == acc_dtype:
                    grad_weight_t.addmm_(scaled_t, numerators)
                else:  # a low-precision matmul, accumulated across chunks in float32
                    grad_weight_t += scaled_t @ numerators
            if grad_hidden is not None:
                grad_hidden -= smoothing * weight_mean  # the uniform term: (ε / V) * sum_v W_v
        grad_weight = grad_weight_t[:d_model].T.contiguous() if grad_weight_t is not None else None  # (V, D)
        grad_bias = grad_weight_t[d_model] if grad_weight_t is not None and bias is not None else None  # (V,)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        bias_grad = (grad_bias * grad_loss).to(bias_dtype) if grad_bias is not None else None
        return ((grad_hidden * grad_loss).to(hidden_dtype), (grad_weight * grad_loss).to(weight_dtype), bias_grad,
                None, None, None)


def linear_rdrop_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, *, bias: Tensor | None = None, smoothing: float, alpha: float,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """R-Drop's loss (Liang et al. 2021) over two passes' states, its logits never held whole.

    hidden: (2N, D), rows i and N + i the states of one target position in two passes (their own dropout masks);
    target: (N,) the positions' ids; weight (V, D), bias (V,) or None as linear_label_smoothed_nll's. Returns the
    summed loss, label-smoothed cross-entropy of both passes plus alpha / 2 * (KL(p1 || p2) + KL(p2 || p1)) at
    each position (as fairseq's R-Drop criterion sums it), and both passes' summed NLL (for logging).
    """
    if chunk_rows is None:  # a chunk holds about seven (n, V) tensors, where the one-pass loss holds one
        chunk_elements = CPU_CHUNK_ELEMENTS if hidden.device.type == "cpu" else GPU_CHUNK_ELEMENTS
        chunk_rows = max(1, chunk_elements // (4 * weight.size(0)))
    if hidden.size(0) != 2 * target.size(0):
        raise ValueError(f"R-Drop takes two passes' states for each target: {hidden.size(0)} rows for "
                         f"{target.size(0)} targets")
    return _LinearRDropLoss.apply(hidden, weight, bias, target, smoothing, alpha, chunk_rows)


class _LinearRDropLoss(torch.autograd.Function):
    """The two passes' losses and gradients, chunk by chunk in forward; backward scales them by the upstream gradient.

    Per position, with log-probabilities l1, l2 and probabilities p1, p2 of the two passes, d = l1 - l2 and
    a = alpha / 2, the gradients with respect to the two passes' logits are

        G1 = p1 - (1 - ε) onehot(y) - ε / V + a * (p1 * (d - KL(p1 || p2)) + p1 - p2)
        G2 = p2 - (1 - ε) onehot(y) - ε / V + a * (p2 * (-d - KL(p2 || p1)) + p2 - p1)

    (the first three terms are the smoothed cross-entropy's, as in _LinearLabelSmoothedNLL; the last, the symmetric
    KL's, ties each pass to the other). As there, the uniform ε / V term and the logits' mean are rank-one
    corrections in float32, off the (n, V) passes; the rest of each G is written out per chunk (about twice the
    one-pass loss's (n, V) passes per row, where R-Drop doubles the model's work in any case). Softmax and gradients in float32; under autocast
    the matmuls in the autocast dtype, the weight's gradient accumulated transposed and row-major (the one-pass
    loss says why).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, smoothing: float,
                alpha: float, chunk_rows: int):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        acc_dtype = torch.promote_types(dtype, torch.float32)
        pairs, d_model = target.size(0), hidden.size(1)
        vocab, half = weight.size(0), alpha / 2
        with torch.autocast(device, enabled=False):
            hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)
            hidden32 = hidden_c.to(acc_dtype)  # (2N, D): the rows the matmuls see, for the float32 side
            bias_c = bias.to(acc_dtype) if bias is not None else None
            weight_mean = weight.to(acc_dtype).mean(dim=0)  # (D,): mean_v(z) = h . mean_v(W) + mean(b)
            bias_mean = bias.to(acc_dtype).mean() if bias is not None else 0.0
            loss_sum = hidden.new_zeros((), dtype=acc_dtype)
            nll_sum = hidden.new_zeros((), dtype=acc_dtype)
            grad_hidden = hidden.new_empty((2 * pairs, d_model), dtype=acc_dtype)  # (2N, D)
            # (D + 1, V): the weight's gradient transposed, then the bias's; the uniform term's share to start with
            grad_weight_t = torch.empty((d_model + 1, vocab), dtype=acc_dtype, device=hidden.device)
            grad_weight_t[:d_model] = (-smoothing / vocab * hidden32.sum(dim=0))[:, None]
            grad_weight_t[d_model] = -smoothing / vocab * 2 * pairs
            for start in range(0, pairs, chunk_rows):
                end = min(start + chunk_rows, pairs)
                y = target[start:end, None]  # (n, 1)
                rows = (slice(start, end), slice(pairs + start, pairs + end))  # the first pass's rows, the second's
                log_probs, probs = [], []
                for part in rows:  # each pass: its log-probabilities and probabilities, (n, V) in float32
                    logits = (hidden_c[part] @ weight_c.T).to(acc_dtype)
                    if bias_c is not None:
                        logits += bias_c
                    peak = logits.amax(dim=-1, keepdim=True)  # (n, 1)
                    p = exp_(logits - peak)  # exp_ avoids a slow path (model/numerics.py)
                    total = p.sum(dim=-1, keepdim=True)
                    lse = total.log() + peak
                    nll = lse - logits.gather(-1, y)  # (n, 1)
                    mean_logit = hidden32[part] @ weight_mean + bias_mean  # (n,)
                    loss_sum += ((1 - smoothing) * nll.sum() + smoothing * (lse.squeeze(1) - mean_logit).sum())
                    nll_sum += nll.sum()
                    log_probs.append(logits.sub_(lse))
                    probs.append(p.div_(total))
                (l1, l2), (p1, p2) = log_probs, probs
                d = l1.sub_(l2)  # (n, V): l1 is not needed again
                kl_12, kl_21 = torch.linalg.vecdot(p1, d)[:, None], -torch.linalg.vecdot(p2, d)[:, None]  # (n, 1)
                loss_sum += half * (kl_12 + kl_21).sum()
                # G1 + ε / V = p1 * (1 + a - a KL12 + a d) - a p2 (into l2's memory), G2 + ε / V likewise (into d's)
                grads = (torch.add(1 + half - half * kl_12, d, alpha=half, out=l2).mul_(p1).add_(p2, alpha=-half),
                         torch.add(1 + half - half * kl_21, d, alpha=-half, out=d).mul_(p2).add_(p1, alpha=-half))
                for part, grad in zip(rows, grads, strict=True):  # the target's share, then the two matmuls a pass
                    grad = grad.scatter_add_(-1, y, y.new_full(y.shape, smoothing - 1, dtype=acc_dtype)).to(dtype)
                    grad_hidden[part] = (grad @ weight_c).to(acc_dtype)
                    with_bias = torch.cat((hidden32[part], hidden32.new_ones(y.size(0), 1)), dim=1).T.contiguous()
                    if dtype == acc_dtype:  # (D + 1, n) @ (n, V)
                        grad_weight_t.addmm_(with_bias, grad)
                    else:  # a low-precision matmul, accumulated across chunks in float32
                        grad_weight_t += with_bias.to(dtype) @ grad
            grad_hidden -= smoothing * weight_mean  # the uniform term: (ε / V) * sum_v W_v
        grad_weight = grad_weight_t[:d_model].T.contiguous()  # (V, D)
        grad_bias = grad_weight_t[d_model] if bias is not None else None
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        bias_grad = (grad_bias * grad_loss).to(bias_dtype) if grad_bias is not None else None
        return ((grad_hidden * grad_loss).to(hidden_dtype), (grad_weight * grad_loss).to(weight_dtype), bias_grad,
                None, None, None, None)
