# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""C++ kernels of DAR's depth path on CPU, opt-in with `config.dar_inference_kernel = "cpp"` (forwards with gradients
off) and `config.dar_training_kernel = "cpp"` (eager training with the fused "fast" path).

Eager decoding runs every branch on a few tokens, where the DAR path costs the operations it dispatches (a dozen
PyTorch calls per branch, each starting with cold caches after the branch's own matrix products have streamed its
weights; docs/overhead-log.md), not the bytes it moves; prefill runs it on many tokens, where the PyTorch operations
pass over the same [B, T, J, D] operands several times and a kernel, row by row, once. These kernels compute the
same equations as `InferenceDepthBackend` (DESIGN.md section 7) in one call each:

  phase_one(history, S, key_scale, queries, gates, kappa, nu, sees_partial)
      -> gated [R_g, B, T, D], mean [R_p, B, T, J, D], L [R_p, B, T, J]
      phase 1 of R reads (a list of R folded queries [J, D] and gates [J]) over the S committed entries: scores,
      depth softmax with its log-sum-exp and the value sums Obar; a read that also sees the partial (R_p of them,
      in order) gets its Obar and L, which its `read_partial` merges, any other (R_g) its branch input
      sum_j gate_j Obar^j, and nothing else is written;
  read_partial(P, query, gate, mean, L, kappa, nu, eps, like) -> u [B, T, D] in like's dtype
      phase 2 of a read of the partial: u = sum_j gate_j (sigmoid(L_j - z_j) Obar^j + sigmoid(z_j - L_j) P^{nu(j)}),
      rounded to the branch's dtype as `Tensor.to` rounds it;
  write_first(beta, y)                                        -> P [B, T, J, D]
      (6) at a block's first branch: P = beta * y;
  write_partial(P, rho, beta, y)                              -> P' [B, T, 2, D]
      (6) after a block's first branch: P' = lerp(swap(P), P, rho) + beta * y;
  commit(P, history, n, key_scale, kappa, eps)                -> None
      (8): stores P as entry n of the history (in its dtype) and the per-token key scale
      1 / sqrt(sum_d h^2 + D eps) of each target stream's key stream, of the stored value.

With `config.dar_training_kernel = "cpp"` the fused eager training path (`FastDepthBackend`) runs these, each row a
token, its sources read from memory once per call (the PyTorch operations pass over them once per operation):

  train_read(query, gate, history, inv_rms, n, P, kappa, nu, eps)
      -> u [B, T, D], weights [N, B, T, J], key dots [N, B, T, J], P's inverse RMS [B, T, J]
      one branch's read (eq. 2-5) of the n committed entries in the buffer and the partial P (None: not read), with
      the fast path's key normalisation (inverse RMS 1 / sqrt(mean h^2 + eps), the query w * gamma);
  train_read_backward(g, query, gate, history, inv_rms, n, P, P_inv_rms, weights, key dots, kappa, nu)
      -> d query [J, D], d gate [J], d P [B, T, J, D], entry coefficients [n, B, T, 3, J]
      its backward; of each committed entry only the per-token coefficients of its gradient (value, key, key norm);
  train_read_entry_gradients(history, grad_entries, [g], [query], [coefficients], kappa) -> None
      adds those of several reads (a block's, as `DepthGradients` defers them) into grad_entries [S_max, B, T, J, D]
      in one pass, each entry row read and written once;
  write_backward(g, P, rho, beta, y)                          -> d P, d rho (1,), d beta [J, D], d y (y's dtype)
      the backward of write_first (P None) and write_partial, in one pass.

With `dar_compiled_read = "operator"` as well, a training forward traced by `torch.compile` calls each two-stream
write as a custom operator over the write kernels above (`depth_backends.traced_source_write`) and each read as one
over these (`traced_source_read`):

  read_sources(query, gate, [sources], kappa, nu, eps) -> u [B, T, D], weights, key dots, inverse RMS [N, B, T, J]
      `train_read` over N sources given as separate tensors [B, T, J, D] (the committed entries, then the partial
      if read: a compiled graph has no shared buffer), every source's inverse RMS computed in the same pass;
  read_sources_backward(g, query, gate, [sources], inverse RMS, weights, key dots, kappa, nu)
      -> [d query [J, D], d gate [J], d source [B, T, J, D] for each source]
      its backward, every source's gradient written (a compiled graph adds each entry's gradients itself).

The gradients summed over tokens (query, gate, beta, rho) are summed by fixed chunks of 32 rows and the chunks added
in order, so their bits do not depend on the thread count either (tested).

They are built by `torch.utils.cpp_extension.load_inline` on first use, once per machine and torch installation
(about 40 s on two cores; cached under `TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions), and need a C++
compiler and ninja; where either is missing the build fails once, a warning says why, and the PyTorch operations run
instead. They run eagerly (not traced by `torch.compile` or `torch.export`, whose generated code fuses the same
passes; a compiled graph calls the source operators as they are) and on CPU; the inference kernels with gradients
off and without recorded depth weights. They take any number of tokens (on many, the rows are split over torch's
intra-op threads; on a few, as in decoding, they run on the calling thread). The source is a string in this file so
that a model folder's remote code carries it.

Shape legend as in `depth_backends.py`: B batch, T tokens, D hidden, S committed entries, R reads, J streams.
"""

import hashlib
import platform
import sys

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

// float -> the branch's dtype, rounded as Tensor.to rounds: to nearest even (bfloat16 spelled out with integer
// operations, which vectorise, where c10::BFloat16's constructor does not).
template <typename out_t>
inline out_t to_branch_dtype(float value) {
  return static_cast<out_t>(value);
}
template <>
inline c10::BFloat16 to_branch_dtype<c10::BFloat16>(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return c10::BFloat16(std::isnan(value) ? uint16_t(0x7FC0) : rounded, c10::BFloat16::from_bits());
}
template <typename out_t>
inline out_t to_branch_dtype(double value) {
  return static_cast<out_t>(value);
}

// Rows are the B * T tokens of a forward: a few streams of D values each. Every row is computed alone, in the same
// order of operations, so the rows are split over torch's intra-op threads (`at::parallel_for`, torch's own OpenMP
// runtime) with identical results for any thread count; a call on fewer than about 32K values per thread (decoding:
// a few tokens) runs on the calling thread, where waking the others would cost more than the row work.
inline int64_t row_grain(int64_t values_per_row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, values_per_row));
}

template <typename compute_t, typename history_t>
void phase_one_rows(const history_t* history, int64_t sources, const compute_t* key_scale,
                    const std::vector<const compute_t*>& query, const std::vector<const compute_t*>& gate,
                    const std::vector<int64_t>& key_streams, const std::vector<int64_t>& value_streams, int64_t reads,
                    const std::vector<bool>& sees_partial, const std::vector<int64_t>& slot, int64_t rows,
                    int64_t streams, int64_t hidden, compute_t* gated, compute_t* mean, compute_t* log_sum_exp) {
  const int64_t entry = rows * streams * hidden;  // one committed entry [B, T, J, D]
  // Entry-major: each entry's row is read once for the scores of all R x J (read, target) pairs and once for their
  // value sums, while the R x J queries and sums stay in cache (a pass per pair re-read the history R x J times).
  at::parallel_for(0, rows, row_grain(sources * streams * hidden), [&](int64_t begin, int64_t end) {
    std::vector<compute_t> weights(reads * streams * sources);  // [R, J, S]
    std::vector<compute_t> scratch(reads * streams * hidden);   // Obar of the reads that need only the gated sum
    std::vector<compute_t*> sums(reads);                         // where read r's Obar [J, D] of this row goes
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t r = 0; r < reads; ++r) {
        sums[r] = sees_partial[r] ? mean + (slot[r] * rows + row) * streams * hidden
                                  : scratch.data() + r * streams * hidden;
      }
      for (int64_t s = 0; s < sources; ++s) {  // scores: (B_s^{kappa(j)} . q_rj) * key scale
        for (int64_t j = 0; j < streams; ++j) {
          const history_t* x = history + s * entry + (row * streams + key_streams[j]) * hidden;
          const compute_t scale = key_scale[(s * rows + row) * streams + j];
          // Four reads per pass over x: four independent sums (one sum waits on each add's latency) and x loaded once.
          int64_t r = 0;
          for (; r + 4 <= reads; r += 4) {
            const compute_t *q0 = query[r] + j * hidden, *q1 = query[r + 1] + j * hidden,
                            *q2 = query[r + 2] + j * hidden, *q3 = query[r + 3] + j * hidden;
            compute_t dot0 = 0, dot1 = 0, dot2 = 0, dot3 = 0;
#pragma omp simd reduction(+ : dot0, dot1, dot2, dot3)
            for (int64_t d = 0; d < hidden; ++d) {
              const compute_t value = static_cast<compute_t>(x[d]);
              dot0 += value * q0[d];
              dot1 += value * q1[d];
              dot2 += value * q2[d];
              dot3 += value * q3[d];
            }
            weights[(r * streams + j) * sources + s] = dot0 * scale;
            weights[((r + 1) * streams + j) * sources + s] = dot1 * scale;
            weights[((r + 2) * streams + j) * sources + s] = dot2 * scale;
            weights[((r + 3) * streams + j) * sources + s] = dot3 * scale;
          }
          for (; r < reads; ++r) {
            const compute_t* q = query[r] + j * hidden;  // target j's folded query, sqrt(D) w * gamma
            compute_t dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < hidden; ++d) dot += static_cast<compute_t>(x[d]) * q[d];
            weights[(r * streams + j) * sources + s] = dot * scale;
          }
        }
      }
      for (int64_t pair = 0; pair < reads * streams; ++pair) {  // depth softmax and its log-sum-exp, per (r, j)
        compute_t* w = weights.data() + pair * sources;
        const compute_t top = *std::max_element(w, w + sources);
        compute_t total = 0;
        for (int64_t s = 0; s < sources; ++s) total += (w[s] = std::exp(w[s] - top));
        for (int64_t s = 0; s < sources; ++s) w[s] /= total;
        const int64_t r = pair / streams, j = pair % streams;
        if (sees_partial[r]) log_sum_exp[(slot[r] * rows + row) * streams + j] = std::log(total) + top;
        std::fill_n(sums[r] + j * hidden, hidden, compute_t(0));
      }
      for (int64_t s = 0; s < sources; ++s) {  // Obar^j_r = sum_s a_rjs B_s^{nu(j)}
        for (int64_t j = 0; j < streams; ++j) {
          const history_t* v = history + s * entry + (row * streams + value_streams[j]) * hidden;
          for (int64_t r = 0; r < reads; ++r) {
            const compute_t a = weights[(r * streams + j) * sources + s];
            compute_t* m = sums[r] + j * hidden;
#pragma omp simd
            for (int64_t d = 0; d < hidden; ++d) m[d] += a * static_cast<compute_t>(v[d]);
          }
        }
      }
      for (int64_t r = 0; r < reads; ++r) {  // sum_j gate_rj Obar^j_r, of the reads that do not see the partial
        if (sees_partial[r]) continue;
        compute_t* g = gated + (slot[r] * rows + row) * hidden;
        std::fill_n(g, hidden, compute_t(0));
        for (int64_t j = 0; j < streams; ++j) {
          const compute_t c = gate[r][j];
          const compute_t* m = sums[r] + j * hidden;
#pragma omp simd
          for (int64_t d = 0; d < hidden; ++d) g[d] += c * m[d];
        }
      }
    }
  });
}

std::vector<at::Tensor> phase_one(const at::Tensor& history, int64_t sources, const at::Tensor& key_scale,
                                  const std::vector<at::Tensor>& queries, const std::vector<at::Tensor>& gates,
                                  std::vector<int64_t> key_streams, std::vector<int64_t> value_streams,
                                  std::vector<bool> sees_partial) {
  TORCH_CHECK(history.dim() == 5 && history.is_contiguous() && key_scale.is_contiguous(),
              "phase_one: a contiguous history [S, B, T, J, D] and key scale");
  const int64_t reads = queries.size(), batch = history.size(1), tokens = history.size(2),
                streams = history.size(3), hidden = history.size(4);
  TORCH_CHECK(0 < sources && sources <= history.size(0) && reads > 0 && int64_t(gates.size()) == reads &&
                  int64_t(sees_partial.size()) == reads && int64_t(key_streams.size()) == streams &&
                  int64_t(value_streams.size()) == streams,
              "phase_one: inconsistent shapes");
  std::vector<int64_t> slot(reads);  // each read's index among the reads of its kind
  int64_t partial_reads = 0, gated_reads = 0;
  for (int64_t r = 0; r < reads; ++r) slot[r] = sees_partial[r] ? partial_reads++ : gated_reads++;
  for (int64_t r = 0; r < reads; ++r) {
    TORCH_CHECK(queries[r].is_contiguous() && queries[r].numel() == streams * hidden && gates[r].is_contiguous() &&
                    gates[r].numel() == streams && queries[r].scalar_type() == key_scale.scalar_type() &&
                    gates[r].scalar_type() == key_scale.scalar_type(),
                "phase_one: each read's query [J, D] and gate [J], contiguous, in the compute dtype");
  }
  auto options = key_scale.options();
  at::Tensor gated = at::empty({gated_reads, batch, tokens, hidden}, options);
  at::Tensor mean = at::empty({partial_reads, batch, tokens, streams, hidden}, options);
  at::Tensor log_sum_exp = at::empty({partial_reads, batch, tokens, streams}, options);
  AT_DISPATCH_FLOATING_TYPES(key_scale.scalar_type(), "phase_one", [&] {
    using compute_t = scalar_t;
    std::vector<const compute_t*> query(reads), gate(reads);
    for (int64_t r = 0; r < reads; ++r) {
      query[r] = queries[r].data_ptr<compute_t>();
      gate[r] = gates[r].data_ptr<compute_t>();
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, history.scalar_type(), "phase_one_history", [&] {
      phase_one_rows<compute_t, scalar_t>(history.data_ptr<scalar_t>(), sources, key_scale.data_ptr<compute_t>(),
                                          query, gate, key_streams, value_streams, reads, sees_partial, slot,
                                          batch * tokens, streams, hidden,
                                          gated.data_ptr<compute_t>(), mean.data_ptr<compute_t>(),
                                          log_sum_exp.data_ptr<compute_t>());
    });
  });
  return {gated, mean, log_sum_exp};
}

template <typename scalar_t, typename out_t>
void read_partial_rows(const scalar_t* partial, const scalar_t* query, const scalar_t* gate, const scalar_t* mean,
                       const scalar_t* log_sum_exp, const std::vector<int64_t>& key_streams,
                       const std::vector<int64_t>& value_streams, double eps, int64_t rows, int64_t streams,
                       int64_t hidden, out_t* out) {
  const scalar_t offset = static_cast<scalar_t>(hidden * eps);
  at::parallel_for(0, rows, row_grain(streams * hidden), [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> scale(streams), share(streams), rest(streams), u(hidden);
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* p = partial + row * streams * hidden;
      for (int64_t s = 0; s < streams; ++s) {  // 1 / sqrt(sum_d P^2 + D eps): the inverse RMS over sqrt(D)
        const scalar_t* x = p + s * hidden;
        scalar_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < hidden; ++d) sum += x[d] * x[d];
        scale[s] = 1 / std::sqrt(sum + offset);
      }
      for (int64_t j = 0; j < streams; ++j) {  // the partial's softmax share sigmoid(z_j - L_j), times the gate
        const scalar_t* x = p + key_streams[j] * hidden;
        const scalar_t* q = query + j * hidden;
        scalar_t dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hidden; ++d) dot += x[d] * q[d];
        const scalar_t z = dot * scale[key_streams[j]] - log_sum_exp[row * streams + j];
        share[j] = gate[j] / (1 + std::exp(-z));
        rest[j] = gate[j] / (1 + std::exp(z));  // the entries' share, not gate - share: no cancellation
      }
      // u = sum_j rest_j Obar^j + share_j P^{nu(j)}: not gate_j Obar^j + share_j (P^{nu(j)} - Obar^j), whose
      // rounding is of the size of Obar where the partial dominates (`phase_two` in depth_backends.py)
      std::fill_n(u.data(), hidden, scalar_t(0));
      for (int64_t j = 0; j < streams; ++j) {
        const scalar_t a = rest[j], b = share[j];
        const scalar_t* v = p + value_streams[j] * hidden;
        const scalar_t* m = mean + (row * streams + j) * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) u[d] += a * m[d] + b * v[d];
      }
      // u in the branch's dtype, rounded as Tensor.to rounds (to nearest even), so that no conversion follows the call
      out_t* o = out + row * hidden;
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) o[d] = to_branch_dtype<out_t>(u[d]);
    }
  });
}

at::Tensor read_partial(const at::Tensor& partial, const at::Tensor& query, const at::Tensor& gate,
                        const at::Tensor& mean, const at::Tensor& log_sum_exp,
                        std::vector<int64_t> key_streams, std::vector<int64_t> value_streams, double eps,
                        const at::Tensor& out_like) {
  TORCH_CHECK(partial.dim() == 4 && partial.is_contiguous() && query.is_contiguous() && gate.is_contiguous() &&
                  mean.is_contiguous() && log_sum_exp.is_contiguous(),
              "read_partial: contiguous operands");
  const int64_t batch = partial.size(0), tokens = partial.size(1), streams = partial.size(2), hidden = partial.size(3);
  const int64_t rows = batch * tokens;
  TORCH_CHECK(mean.numel() == rows * streams * hidden &&
                  log_sum_exp.numel() == rows * streams && query.numel() == streams * hidden &&
                  int64_t(key_streams.size()) == streams && int64_t(value_streams.size()) == streams,
              "read_partial: inconsistent shapes");
  at::Tensor out = at::empty({batch, tokens, hidden}, partial.options().dtype(out_like.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "read_partial", [&] {
    using compute_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "read_partial_out", [&] {
      read_partial_rows<compute_t, scalar_t>(
          partial.data_ptr<compute_t>(), query.data_ptr<compute_t>(), gate.data_ptr<compute_t>(),
          mean.data_ptr<compute_t>(), log_sum_exp.data_ptr<compute_t>(), key_streams,
          value_streams, eps, rows, streams, hidden, out.data_ptr<scalar_t>());
    });
  });
  return out;
}

template <typename compute_t, typename history_t>
void commit_rows(const compute_t* entry, history_t* stored, compute_t* key_scale,
                 const std::vector<int64_t>& key_streams, double eps, int64_t rows, int64_t streams, int64_t hidden) {
  const compute_t offset = static_cast<compute_t>(hidden * eps);
  at::parallel_for(0, rows, row_grain(streams * hidden), [&](int64_t begin, int64_t end) {
    std::vector<compute_t> scale(streams);
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t s = 0; s < streams; ++s) {
        const compute_t* x = entry + (row * streams + s) * hidden;
        history_t* h = stored + (row * streams + s) * hidden;
        compute_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < hidden; ++d) {  // the statistics are of the stored (possibly rounded) value
          h[d] = static_cast<history_t>(x[d]);
          const compute_t v = static_cast<compute_t>(h[d]);
          sum += v * v;
        }
        scale[s] = 1 / std::sqrt(sum + offset);
      }
      for (int64_t j = 0; j < streams; ++j) key_scale[row * streams + j] = scale[key_streams[j]];
    }
  });
}

void commit(const at::Tensor& entry, const at::Tensor& history, int64_t slot, const at::Tensor& key_scale,
            std::vector<int64_t> key_streams, double eps) {
  TORCH_CHECK(entry.dim() == 4 && entry.is_contiguous() && history.is_contiguous() && key_scale.is_contiguous() &&
                  entry.scalar_type() == key_scale.scalar_type(),
              "commit: a contiguous entry [B, T, J, D] in the compute dtype, a contiguous history and key scale");
  const int64_t rows = entry.size(0) * entry.size(1), streams = entry.size(2), hidden = entry.size(3);
  TORCH_CHECK(0 <= slot && slot < history.size(0) && history[0].numel() == entry.numel() &&
                  key_scale[0].numel() == rows * streams && int64_t(key_streams.size()) == streams,
              "commit: inconsistent shapes");
  AT_DISPATCH_FLOATING_TYPES(entry.scalar_type(), "commit", [&] {
    using compute_t = scalar_t;
    compute_t* scale = key_scale.data_ptr<compute_t>() + slot * rows * streams;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, history.scalar_type(), "commit_history", [&] {
      commit_rows<compute_t, scalar_t>(entry.data_ptr<compute_t>(), history.data_ptr<scalar_t>() + slot * entry.numel(),
                                       scale, key_streams, eps, rows, streams, hidden);
    });
  });
}

template <typename state_t, typename y_t>
void write_partial_rows(const state_t* partial, state_t rho, const state_t* beta, const y_t* written, int64_t rows,
                        int64_t hidden, state_t* out) {
  const bool low = rho < 0.5;  // torch.lerp's two forms, by the weight
  at::parallel_for(0, rows, row_grain(2 * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const y_t* y = written + row * hidden;
      for (int64_t j = 0; j < 2; ++j) {  // torch.lerp(other, own, rho), then + beta * y
        const state_t* own = partial + (row * 2 + j) * hidden;
        const state_t* other = partial + (row * 2 + 1 - j) * hidden;
        const state_t* b = beta + j * hidden;
        state_t* o = out + (row * 2 + j) * hidden;
        if (low) {
#pragma omp simd
          for (int64_t d = 0; d < hidden; ++d)
            o[d] = (other[d] + rho * (own[d] - other[d])) + b[d] * static_cast<state_t>(y[d]);
        } else {
#pragma omp simd
          for (int64_t d = 0; d < hidden; ++d)
            o[d] = (own[d] - (own[d] - other[d]) * (1 - rho)) + b[d] * static_cast<state_t>(y[d]);
        }
      }
    }
  });
}

at::Tensor write_partial(const at::Tensor& partial, const at::Tensor& rho, const at::Tensor& beta,
                         const at::Tensor& written) {
  TORCH_CHECK(partial.dim() == 4 && partial.size(2) == 2 && partial.is_contiguous() && beta.is_contiguous() &&
                  written.is_contiguous() && rho.numel() == 1 && rho.scalar_type() == partial.scalar_type() &&
                  beta.scalar_type() == partial.scalar_type(),
              "write_partial: a contiguous two-stream partial [B, T, 2, D], beta [2, D], y [B, T, D], rho (1,)");
  const int64_t rows = partial.size(0) * partial.size(1), hidden = partial.size(3);
  TORCH_CHECK(written.numel() == rows * hidden && beta.numel() == 2 * hidden, "write_partial: inconsistent shapes");
  at::Tensor out = at::empty_like(partial);
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "write_partial", [&] {
    using state_t = scalar_t;
    const state_t r = *rho.data_ptr<state_t>();  // not rho.item(): a dispatch per call
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, written.scalar_type(), "write_partial_y", [&] {
      write_partial_rows<state_t, scalar_t>(partial.data_ptr<state_t>(), r, beta.data_ptr<state_t>(),
                                            written.data_ptr<scalar_t>(), rows, hidden, out.data_ptr<state_t>());
    });
  });
  return out;
}

template <typename state_t, typename y_t>
void write_first_rows(const state_t* beta, const y_t* written, int64_t rows, int64_t streams, int64_t hidden,
                      state_t* out) {
  at::parallel_for(0, rows, row_grain(streams * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const y_t* y = written + row * hidden;
      for (int64_t j = 0; j < streams; ++j) {  // P = beta * y, as beta [J, D] * y [B, T, 1, D] promotes it
        const state_t* b = beta + j * hidden;
        state_t* o = out + (row * streams + j) * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) o[d] = b[d] * static_cast<state_t>(y[d]);
      }
    }
  });
}

at::Tensor write_first(const at::Tensor& beta, const at::Tensor& written) {
  TORCH_CHECK(beta.dim() == 2 && beta.is_contiguous() && written.dim() == 3 && written.is_contiguous() &&
                  beta.size(1) == written.size(2),
              "write_first: beta [J, D] and y [B, T, D], contiguous");
  const int64_t streams = beta.size(0), hidden = beta.size(1), rows = written.size(0) * written.size(1);
  at::Tensor out = at::empty({written.size(0), written.size(1), streams, hidden}, beta.options());
  AT_DISPATCH_FLOATING_TYPES(beta.scalar_type(), "write_first", [&] {
    using state_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, written.scalar_type(), "write_first_y", [&] {
      write_first_rows<state_t, scalar_t>(beta.data_ptr<state_t>(), written.data_ptr<scalar_t>(), rows, streams,
                                          hidden, out.data_ptr<state_t>());
    });
  });
  return out;
}

// ---- Training kernels of the fused eager path (`FastDepthBackend`, config.dar_training_kernel = "cpp") ----
// Sums over tokens (the gradients of the query, the read gate and the write gate) are taken over fixed chunks of
// rows, each into its own slot, and the slots are added in order afterwards: the same bits for any thread count.
constexpr int64_t kChunkRows = 32;
inline int64_t chunk_count(int64_t rows) { return (rows + kChunkRows - 1) / kChunkRows; }

// [C, ...] -> [...]: the chunks' partial sums added in chunk order (deterministic, unlike a threaded reduction).
template <typename scalar_t>
void sum_chunks_of(const scalar_t* part, int64_t chunks, int64_t size, scalar_t* out) {
  for (int64_t c = 0; c < chunks; ++c) {
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) out[i] += part[c * size + i];
  }
}

at::Tensor sum_chunks(const at::Tensor& chunks) {
  at::Tensor total = at::zeros(chunks.sizes().slice(1), chunks.options());
  AT_DISPATCH_FLOATING_TYPES(chunks.scalar_type(), "sum_chunks", [&] {
    sum_chunks_of<scalar_t>(chunks.data_ptr<scalar_t>(), chunks.size(0), total.numel(), total.data_ptr<scalar_t>());
  });
  return total;
}

// a . b over n values in four partial sums over the quarters of the range: each vector add waits on the previous
// one's latency, so one sum leaves the FMA units mostly idle (a read's dots ran at a quarter of their speed).
template <typename scalar_t>
inline scalar_t dot_of(const scalar_t* a, const scalar_t* b, int64_t n) {
  const int64_t q = n / 4;
  scalar_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < q; ++d) {
    s0 += a[d] * b[d];
    s1 += a[q + d] * b[q + d];
    s2 += a[2 * q + d] * b[2 * q + d];
    s3 += a[3 * q + d] * b[3 * q + d];
  }
  scalar_t rest = 0;
  for (int64_t d = 4 * q; d < n; ++d) rest += a[d] * b[d];
  return ((s0 + s1) + (s2 + s3)) + rest;
}

// The sources of one read, each [rows, J, D] with its inverse RMS [rows, J]: the committed entries (the first
// `entries`; rows of the history buffer [S_max, rows, J, D], or separate tensors), then the partial if read. The
// inverse RMS of sources `computed` and after is computed by the forward, into `computed_inv_rms` [N - computed,
// rows, J], which `inv_rms` of those sources points into.
template <typename scalar_t>
struct ReadSources {
  std::vector<const scalar_t*> source, inv_rms;
  scalar_t* computed_inv_rms;
  int64_t entries, computed, rows, streams, hidden;
  int64_t count() const { return source.size(); }
  const scalar_t* row(int64_t n, int64_t r) const { return source[n] + r * streams * hidden; }
  scalar_t scale(int64_t n, int64_t r, int64_t s) const { return inv_rms[n][r * streams + s]; }
};

// Forward of one read (eq. 2-5): key dots of the folded query with each source's key stream, the depth softmax
// of (dot * inverse RMS), and u = sum_j gate_j sum_n a^j_n V^{nu(j)}_n; writes u [rows, D], the weights and key
// dots [N, rows, J], and the inverse RMS of the sources that `src` says are computed here.
template <typename scalar_t>
void train_read_rows(const scalar_t* query, const scalar_t* gate, const ReadSources<scalar_t>& src,
                     const std::vector<int64_t>& kappa, const std::vector<int64_t>& nu, double eps, scalar_t* u,
                     scalar_t* weights, scalar_t* keyed) {
  const int64_t rows = src.rows, streams = src.streams, hidden = src.hidden, count = src.count();
  at::parallel_for(0, rows, row_grain(count * streams * hidden), [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> w(count * streams);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t n = src.computed; n < count; ++n) {  // 1 / sqrt(mean_d h^2 + eps), as `inverse_rms`
        for (int64_t s = 0; s < streams; ++s) {
          const scalar_t* x = src.row(n, r) + s * hidden;
          const scalar_t sum = dot_of(x, x, hidden);
          src.computed_inv_rms[((n - src.computed) * rows + r) * streams + s] =
              1 / std::sqrt(sum / hidden + static_cast<scalar_t>(eps));
        }
      }
      for (int64_t n = 0; n < count; ++n) {
        const scalar_t* x = src.row(n, r);
        for (int64_t j = 0; j < streams; ++j) {
          const scalar_t dot = dot_of(x + kappa[j] * hidden, query + j * hidden, hidden);
          keyed[(n * rows + r) * streams + j] = dot;
          w[n * streams + j] = dot * src.scale(n, r, kappa[j]);
        }
      }
      for (int64_t j = 0; j < streams; ++j) {  // softmax over depth
        scalar_t top = w[j];
        for (int64_t n = 1; n < count; ++n) top = std::max(top, w[n * streams + j]);
        scalar_t total = 0;
        for (int64_t n = 0; n < count; ++n) total += (w[n * streams + j] = std::exp(w[n * streams + j] - top));
        for (int64_t n = 0; n < count; ++n) {
          w[n * streams + j] /= total;
          weights[(n * rows + r) * streams + j] = w[n * streams + j];
        }
      }
      scalar_t* o = u + r * hidden;
      std::fill_n(o, hidden, scalar_t(0));
      for (int64_t n = 0; n < count; ++n) {
        const scalar_t* x = src.row(n, r);
        for (int64_t j = 0; j < streams; ++j) {
          const scalar_t c = gate[j] * w[n * streams + j];
          const scalar_t* v = x + nu[j] * hidden;
#pragma omp simd
          for (int64_t d = 0; d < hidden; ++d) o[d] += c * v[d];
        }
      }
    }
  });
}

// The sources of a fused eager read: the first `entries` rows of the history buffer [S_max, B, T, J, D] with their
// inverse RMS [S_max, B, T, J], then the partial with its inverse RMS [B, T, J] (computed by the forward) if read.
template <typename scalar_t>
ReadSources<scalar_t> buffer_sources(const at::Tensor& history, const at::Tensor& inv_rms, int64_t entries,
                                     const std::optional<at::Tensor>& partial,
                                     const std::optional<at::Tensor>& partial_inv_rms) {
  const int64_t rows = history.size(1) * history.size(2), streams = history.size(3), hidden = history.size(4);
  ReadSources<scalar_t> src{{}, {}, nullptr, entries, entries, rows, streams, hidden};
  for (int64_t n = 0; n < entries; ++n) {
    src.source.push_back(history.data_ptr<scalar_t>() + n * rows * streams * hidden);
    src.inv_rms.push_back(inv_rms.data_ptr<scalar_t>() + n * rows * streams);
  }
  if (partial.has_value()) {
    src.source.push_back(partial->data_ptr<scalar_t>());
    src.inv_rms.push_back(partial_inv_rms->data_ptr<scalar_t>());
    src.computed_inv_rms = partial_inv_rms->data_ptr<scalar_t>();
  }
  return src;
}

// The sources of a read traced by torch.compile (`read_sources` below): separate tensors [B, T, J, D], all counted
// as entries (each one's gradient written in full), every inverse RMS computed by the forward into inv_rms
// [N, B, T, J].
template <typename scalar_t>
ReadSources<scalar_t> list_sources(const std::vector<at::Tensor>& sources, const at::Tensor& inv_rms) {
  const int64_t rows = sources[0].size(0) * sources[0].size(1), streams = sources[0].size(2),
                hidden = sources[0].size(3), count = sources.size();
  ReadSources<scalar_t> src{{}, {}, inv_rms.data_ptr<scalar_t>(), count, 0, rows, streams, hidden};
  for (size_t n = 0; n < sources.size(); ++n) {
    src.source.push_back(sources[n].data_ptr<scalar_t>());
    src.inv_rms.push_back(inv_rms.data_ptr<scalar_t>() + n * rows * streams);
  }
  return src;
}

void check_read_operands(const char* name, const at::Tensor& query, const at::Tensor& gate, int64_t rows,
                         int64_t streams, int64_t hidden, const std::vector<int64_t>& key_streams,
                         const std::vector<int64_t>& value_streams, at::ScalarType dtype) {
  TORCH_CHECK(query.is_contiguous() && gate.is_contiguous() && query.numel() == streams * hidden &&
                  gate.numel() == streams && int64_t(key_streams.size()) == streams &&
                  int64_t(value_streams.size()) == streams && query.scalar_type() == dtype &&
                  gate.scalar_type() == dtype,
              name, ": query [J, D] and gate [J] contiguous in the sources' dtype, one key and value stream per target");
  for (int64_t j = 0; j < streams; ++j) {
    TORCH_CHECK(0 <= key_streams[j] && key_streams[j] < streams && 0 <= value_streams[j] && value_streams[j] < streams,
                name, ": stream indices within [0, J)");
  }
}

std::vector<at::Tensor> train_read(const at::Tensor& query, const at::Tensor& gate, const at::Tensor& history,
                                   const at::Tensor& inv_rms, int64_t entries, const std::optional<at::Tensor>& partial,
                                   std::vector<int64_t> key_streams, std::vector<int64_t> value_streams, double eps) {
  TORCH_CHECK(history.dim() == 5 && history.is_contiguous() && inv_rms.is_contiguous(),
              "train_read: a contiguous history buffer [S_max, B, T, J, D] and its inverse RMS");
  const int64_t batch = history.size(1), tokens = history.size(2), streams = history.size(3), hidden = history.size(4);
  const int64_t rows = batch * tokens, has_partial = partial.has_value() ? 1 : 0, count = entries + has_partial;
  const auto dtype = history.scalar_type();
  check_read_operands("train_read", query, gate, rows, streams, hidden, key_streams, value_streams, dtype);
  TORCH_CHECK(0 <= entries && entries <= history.size(0) && count > 0 && inv_rms.numel() == history.numel() / hidden &&
                  inv_rms.scalar_type() == dtype,
              "train_read: inconsistent shapes");
  if (has_partial) {
    TORCH_CHECK(partial->is_contiguous() && partial->scalar_type() == dtype && partial->numel() == rows * streams * hidden,
                "train_read: a contiguous partial [B, T, J, D] in the compute dtype");
  }
  auto options = history.options();
  at::Tensor u = at::empty({batch, tokens, hidden}, options);
  at::Tensor weights = at::empty({count, batch, tokens, streams}, options);
  at::Tensor keyed = at::empty({count, batch, tokens, streams}, options);
  at::Tensor partial_inv_rms = at::empty({has_partial ? batch : 0, tokens, streams}, options);
  AT_DISPATCH_FLOATING_TYPES(dtype, "train_read", [&] {
    const auto src = buffer_sources<scalar_t>(history, inv_rms, entries, partial, partial_inv_rms);
    train_read_rows<scalar_t>(query.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), src, key_streams,
                              value_streams, eps, u.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>(),
                              keyed.data_ptr<scalar_t>());
  });
  return {u, weights, keyed, partial_inv_rms};
}

// The sources of one read as separate tensors, all in one dtype, [B, T, J, D] each.
void check_sources(const char* name, const std::vector<at::Tensor>& sources) {
  TORCH_CHECK(!sources.empty() && sources[0].dim() == 4, name, ": at least one source [B, T, J, D]");
  for (const auto& source : sources) {
    TORCH_CHECK(source.is_contiguous() && source.sizes() == sources[0].sizes() &&
                    source.scalar_type() == sources[0].scalar_type(),
                name, ": contiguous sources of one shape and dtype");
  }
}

// `train_read` of sources given as separate tensors (the committed entries and, last, the partial if read), every
// source's inverse RMS computed in the same pass: -> u [B, T, D], weights, key dots and inverse RMS [N, B, T, J].
std::vector<at::Tensor> read_sources(const at::Tensor& query, const at::Tensor& gate,
                                     const std::vector<at::Tensor>& sources, std::vector<int64_t> key_streams,
                                     std::vector<int64_t> value_streams, double eps) {
  check_sources("read_sources", sources);
  const int64_t batch = sources[0].size(0), tokens = sources[0].size(1), streams = sources[0].size(2),
                hidden = sources[0].size(3), count = sources.size();
  const auto dtype = sources[0].scalar_type();
  check_read_operands("read_sources", query, gate, batch * tokens, streams, hidden, key_streams, value_streams, dtype);
  auto options = sources[0].options();
  at::Tensor u = at::empty({batch, tokens, hidden}, options);
  at::Tensor weights = at::empty({count, batch, tokens, streams}, options);
  at::Tensor keyed = at::empty({count, batch, tokens, streams}, options);
  at::Tensor inv_rms = at::empty({count, batch, tokens, streams}, options);
  AT_DISPATCH_FLOATING_TYPES(dtype, "read_sources", [&] {
    const auto src = list_sources<scalar_t>(sources, inv_rms);
    train_read_rows<scalar_t>(query.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), src, key_streams,
                              value_streams, eps, u.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>(),
                              keyed.data_ptr<scalar_t>());
  });
  return {u, weights, keyed, inv_rms};
}

// Backward of one read, token by token, with each token's sources read from memory once (the next pass over them
// hits the cache): value dots g . V_n, the softmax backward over depth, the query's and the gate's gradients (summed
// over tokens by fixed chunks), the partial's gradient (written), and for every committed entry n the per-token
// coefficients of its gradient, [n, rows, 3, J]: by stream s the value coefficient c^s_n and the key-norm coefficient
// k^s_n = -(dL/d rms^-1) rms^-3 / D, by target j the key coefficient gk^j_n, so that
//   dL/dS^s_n = c^s_n g + sum_{j: kappa(j) = s} gk^j_n q^j + k^s_n S^s_n
// (`train_read_entry_gradients` adds these for all reads of a block at once).
template <typename scalar_t>
void train_read_backward_rows(const scalar_t* grad_u, const scalar_t* query, const scalar_t* gate,
                              const ReadSources<scalar_t>& src, const scalar_t* weights, const scalar_t* keyed,
                              const std::vector<int64_t>& kappa, const std::vector<int64_t>& nu,
                              scalar_t* entry_coefficients, const std::vector<scalar_t*>& grad_sources,
                              scalar_t* chunk_query, scalar_t* chunk_gate) {
  const int64_t rows = src.rows, streams = src.streams, hidden = src.hidden, count = src.count();
  const int64_t chunks = chunk_count(rows);
  const int64_t grain = std::max<int64_t>(1, row_grain(count * streams * hidden) / kChunkRows);
  const int64_t written = entry_coefficients != nullptr ? src.entries : 0;  // the first source whose gradient is written
  at::parallel_for(0, chunks, grain, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<scalar_t> value_dots(count * streams), grad_keyed(count * streams), coefficient(count * streams),
        norm(count * streams), gated_dots(count);
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      scalar_t* gq = chunk_query + chunk * streams * hidden;
      scalar_t* gg = chunk_gate + chunk * streams;
      std::fill_n(gq, streams * hidden, scalar_t(0));
      std::fill_n(gg, streams, scalar_t(0));
      for (int64_t r = chunk * kChunkRows; r < std::min(rows, (chunk + 1) * kChunkRows); ++r) {
        const scalar_t* g = grad_u + r * hidden;
        for (int64_t n = 0; n < count; ++n) {  // g . S^s_n for every stream s
          const scalar_t* x = src.row(n, r);
          for (int64_t s = 0; s < streams; ++s) value_dots[n * streams + s] = dot_of(x + s * hidden, g, hidden);
        }
        std::fill_n(coefficient.data(), count * streams, scalar_t(0));
        std::fill_n(norm.data(), count * streams, scalar_t(0));
        for (int64_t j = 0; j < streams; ++j) {
          // The softmax backward's mean, sum_n a_n (gate_j g . V_n), over the same rounded products gate_j g . V_n
          // as each score's term below (`gated_dots`, stored once): a compiler contracting gate_j g . V_n - mean into
          // one fused multiply-add (-O3 -march=native) took the exact product there, and a confident read's score
          // gradient, which cancels to the products' rounding, came out up to 800x the reference's float32 error.
          scalar_t expected = 0;
          for (int64_t n = 0; n < count; ++n) {
            const scalar_t a = weights[(n * rows + r) * streams + j], dot = value_dots[n * streams + nu[j]];
            gg[j] += a * dot;
            gated_dots[n] = gate[j] * dot;
            expected += a * gated_dots[n];
          }
          for (int64_t n = 0; n < count; ++n) {
            const scalar_t a = weights[(n * rows + r) * streams + j];
            const scalar_t grad_score = a * (gated_dots[n] - expected);
            grad_keyed[n * streams + j] = grad_score * src.scale(n, r, kappa[j]);
            norm[n * streams + kappa[j]] += grad_score * keyed[(n * rows + r) * streams + j];
            coefficient[n * streams + nu[j]] += a * gate[j];
          }
        }
        for (int64_t n = 0; n < count; ++n) {
          for (int64_t s = 0; s < streams; ++s) {  // the norm term's coefficient k^s_n
            const scalar_t inv = src.scale(n, r, s);
            norm[n * streams + s] = -norm[n * streams + s] * inv * inv * inv / hidden;
          }
          const scalar_t* x = src.row(n, r);
          for (int64_t j = 0; j < streams; ++j) {  // the query's gradient: gk^j_n S^{kappa(j)}_n
            const scalar_t gk = grad_keyed[n * streams + j];
            const scalar_t* v = x + kappa[j] * hidden;
            scalar_t* gqj = gq + j * hidden;
#pragma omp simd
            for (int64_t d = 0; d < hidden; ++d) gqj[d] += gk * v[d];
          }
          if (n < written) {
            scalar_t* out = entry_coefficients + (n * rows + r) * 3 * streams;
            std::copy_n(coefficient.data() + n * streams, streams, out);
            std::copy_n(grad_keyed.data() + n * streams, streams, out + streams);
            std::copy_n(norm.data() + n * streams, streams, out + 2 * streams);
            continue;
          }
          for (int64_t s = 0; s < streams; ++s) {  // the source's gradient, written
            const scalar_t* v = x + s * hidden;
            scalar_t* o = grad_sources[n - written] + (r * streams + s) * hidden;
            const scalar_t c = coefficient[n * streams + s], k = norm[n * streams + s];
#pragma omp simd
            for (int64_t d = 0; d < hidden; ++d) o[d] = c * g[d] + k * v[d];
            for (int64_t j = 0; j < streams; ++j) {  // the key path of every target j keyed by stream s
              if (kappa[j] != s) continue;
              const scalar_t gk = grad_keyed[n * streams + j];
              const scalar_t* q = query + j * hidden;
#pragma omp simd
              for (int64_t d = 0; d < hidden; ++d) o[d] += gk * q[d];
            }
          }
        }
      }
    }
  });
}

void check_read_statistics(const char* name, const at::Tensor& grad_u, const at::Tensor& weights,
                           const at::Tensor& keyed, int64_t count, int64_t rows, int64_t streams, int64_t hidden,
                           at::ScalarType dtype) {
  TORCH_CHECK(grad_u.is_contiguous() && weights.is_contiguous() && keyed.is_contiguous() &&
                  grad_u.numel() == rows * hidden && weights.numel() == count * rows * streams &&
                  keyed.numel() == weights.numel() && grad_u.scalar_type() == dtype && weights.scalar_type() == dtype &&
                  keyed.scalar_type() == dtype,
              name, ": contiguous d u [B, T, D], weights and key dots [N, B, T, J] in the sources' dtype");
}

std::vector<at::Tensor> train_read_backward(const at::Tensor& grad_u, const at::Tensor& query, const at::Tensor& gate,
                                            const at::Tensor& history, const at::Tensor& inv_rms, int64_t entries,
                                            const std::optional<at::Tensor>& partial,
                                            const std::optional<at::Tensor>& partial_inv_rms, const at::Tensor& weights,
                                            const at::Tensor& keyed, std::vector<int64_t> key_streams,
                                            std::vector<int64_t> value_streams) {
  TORCH_CHECK(history.dim() == 5 && history.is_contiguous() && inv_rms.is_contiguous(),
              "train_read_backward: a contiguous history buffer and its inverse RMS");
  const int64_t batch = history.size(1), tokens = history.size(2), streams = history.size(3), hidden = history.size(4);
  const int64_t rows = batch * tokens, has_partial = partial.has_value() ? 1 : 0, count = entries + has_partial;
  const auto dtype = history.scalar_type();
  check_read_operands("train_read_backward", query, gate, rows, streams, hidden, key_streams, value_streams, dtype);
  check_read_statistics("train_read_backward", grad_u, weights, keyed, count, rows, streams, hidden, dtype);
  TORCH_CHECK(0 <= entries && entries <= history.size(0), "train_read_backward: more entries than the buffer holds");
  if (has_partial) {
    TORCH_CHECK(partial_inv_rms.has_value() && partial->is_contiguous() && partial_inv_rms->is_contiguous(),
                "train_read_backward: the partial needs its inverse RMS");
  }
  const int64_t chunks = chunk_count(rows);
  auto options = history.options();
  at::Tensor chunk_query = at::empty({chunks, streams, hidden}, options);
  at::Tensor chunk_gate = at::empty({chunks, streams}, options);
  at::Tensor grad_partial = at::empty({has_partial ? batch : 0, tokens, streams, hidden}, options);
  at::Tensor entry_coefficients = at::empty({entries, rows, 3, streams}, options);
  AT_DISPATCH_FLOATING_TYPES(dtype, "train_read_backward", [&] {
    const auto src = buffer_sources<scalar_t>(history, inv_rms, entries, partial, partial_inv_rms);
    train_read_backward_rows<scalar_t>(grad_u.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(),
                                       gate.data_ptr<scalar_t>(), src, weights.data_ptr<scalar_t>(),
                                       keyed.data_ptr<scalar_t>(), key_streams, value_streams,
                                       entry_coefficients.data_ptr<scalar_t>(),
                                       std::vector<scalar_t*>{has_partial ? grad_partial.data_ptr<scalar_t>() : nullptr},
                                       chunk_query.data_ptr<scalar_t>(), chunk_gate.data_ptr<scalar_t>());
  });
  return {sum_chunks(chunk_query), sum_chunks(chunk_gate), grad_partial, entry_coefficients};
}

// The backward of `read_sources`, every source's gradient written: -> d query [J, D], d gate [J], then one d source
// [B, T, J, D] each (separate allocations: one [N, B, T, J, D] block is past the size up to which glibc reuses freed
// memory (32 MB) at the 1B width already, and its fresh pages cost more than writing them).
std::vector<at::Tensor> read_sources_backward(const at::Tensor& grad_u, const at::Tensor& query, const at::Tensor& gate,
                                              const std::vector<at::Tensor>& sources, const at::Tensor& inv_rms,
                                              const at::Tensor& weights, const at::Tensor& keyed,
                                              std::vector<int64_t> key_streams, std::vector<int64_t> value_streams) {
  check_sources("read_sources_backward", sources);
  const int64_t batch = sources[0].size(0), tokens = sources[0].size(1), streams = sources[0].size(2),
                hidden = sources[0].size(3), count = sources.size(), rows = batch * tokens;
  const auto dtype = sources[0].scalar_type();
  check_read_operands("read_sources_backward", query, gate, rows, streams, hidden, key_streams, value_streams, dtype);
  check_read_statistics("read_sources_backward", grad_u, weights, keyed, count, rows, streams, hidden, dtype);
  TORCH_CHECK(inv_rms.is_contiguous() && inv_rms.numel() == weights.numel() && inv_rms.scalar_type() == dtype,
              "read_sources_backward: the sources' inverse RMS [N, B, T, J] from read_sources");
  const int64_t chunks = chunk_count(rows);
  auto options = sources[0].options();
  at::Tensor chunk_query = at::empty({chunks, streams, hidden}, options);
  at::Tensor chunk_gate = at::empty({chunks, streams}, options);
  std::vector<at::Tensor> grads{at::Tensor(), at::Tensor()};  // the query's and the gate's, summed below
  for (int64_t n = 0; n < count; ++n) grads.push_back(at::empty({batch, tokens, streams, hidden}, options));
  AT_DISPATCH_FLOATING_TYPES(dtype, "read_sources_backward", [&] {
    const auto src = list_sources<scalar_t>(sources, inv_rms);
    std::vector<scalar_t*> grad_sources;
    for (int64_t n = 0; n < count; ++n) grad_sources.push_back(grads[2 + n].data_ptr<scalar_t>());
    train_read_backward_rows<scalar_t>(grad_u.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(),
                                       gate.data_ptr<scalar_t>(), src, weights.data_ptr<scalar_t>(),
                                       keyed.data_ptr<scalar_t>(), key_streams, value_streams, nullptr,
                                       grad_sources, chunk_query.data_ptr<scalar_t>(), chunk_gate.data_ptr<scalar_t>());
  });
  grads[0] = sum_chunks(chunk_query);
  grads[1] = sum_chunks(chunk_gate);
  return grads;
}

// The committed entries' gradients from R reads' backwards at once (a block's reads, as `DepthGradients` defers
// them), added into grad_entries [S_max, rows, J, D]: for each token and entry n, read r (those with n_r > n) adds
//   c^s_rn g_r + sum_{j: kappa(j) = s} gk^j_rn q^j_r + k^s_rn S^s_n,
// so each entry row is read and written once per block instead of once per read.
template <typename scalar_t>
void entry_gradients_rows(const scalar_t* history, scalar_t* grad_entries, const std::vector<const scalar_t*>& grad_u,
                          const std::vector<const scalar_t*>& query, const std::vector<const scalar_t*>& coefficients,
                          const std::vector<int64_t>& entries, const std::vector<int64_t>& kappa, int64_t rows,
                          int64_t streams, int64_t hidden) {
  const int64_t reads = grad_u.size();
  const int64_t most = *std::max_element(entries.begin(), entries.end());
  at::parallel_for(0, rows, row_grain(most * streams * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t n = 0; n < most; ++n) {
        for (int64_t s = 0; s < streams; ++s) {
          const scalar_t* v = history + ((n * rows + r) * streams + s) * hidden;
          scalar_t* o = grad_entries + ((n * rows + r) * streams + s) * hidden;
          scalar_t k = 0;
          for (int64_t i = 0; i < reads; ++i) {
            if (n < entries[i]) k += coefficients[i][((n * rows + r) * 3 + 2) * streams + s];
          }
#pragma omp simd
          for (int64_t d = 0; d < hidden; ++d) o[d] += k * v[d];
          for (int64_t i = 0; i < reads; ++i) {
            if (n >= entries[i]) continue;
            const scalar_t* coefficient = coefficients[i] + (n * rows + r) * 3 * streams;
            const scalar_t c = coefficient[s];
            const scalar_t* g = grad_u[i] + r * hidden;
#pragma omp simd
            for (int64_t d = 0; d < hidden; ++d) o[d] += c * g[d];
            for (int64_t j = 0; j < streams; ++j) {
              if (kappa[j] != s) continue;
              const scalar_t gk = coefficient[streams + j];
              const scalar_t* q = query[i] + j * hidden;
#pragma omp simd
              for (int64_t d = 0; d < hidden; ++d) o[d] += gk * q[d];
            }
          }
        }
      }
    }
  });
}

void train_read_entry_gradients(const at::Tensor& history, const at::Tensor& grad_entries,
                                const std::vector<at::Tensor>& grads_u, const std::vector<at::Tensor>& queries,
                                const std::vector<at::Tensor>& coefficients, std::vector<int64_t> key_streams) {
  TORCH_CHECK(history.dim() == 5 && history.is_contiguous() && grad_entries.is_contiguous() &&
                  grad_entries.sizes() == history.sizes() && grad_entries.scalar_type() == history.scalar_type(),
              "train_read_entry_gradients: a contiguous history buffer and entry gradients of its shape and dtype");
  const int64_t reads = grads_u.size(), rows = history.size(1) * history.size(2), streams = history.size(3),
                hidden = history.size(4);
  TORCH_CHECK(reads > 0 && int64_t(queries.size()) == reads && int64_t(coefficients.size()) == reads &&
                  int64_t(key_streams.size()) == streams,
              "train_read_entry_gradients: one gradient, query and coefficient tensor per read");
  std::vector<int64_t> entries(reads);
  for (int64_t i = 0; i < reads; ++i) {
    TORCH_CHECK(grads_u[i].is_contiguous() && queries[i].is_contiguous() && coefficients[i].is_contiguous() &&
                    grads_u[i].numel() == rows * hidden && queries[i].numel() == streams * hidden &&
                    coefficients[i].dim() == 4 && coefficients[i].size(0) <= history.size(0) &&
                    coefficients[i].numel() == coefficients[i].size(0) * rows * 3 * streams &&
                    grads_u[i].scalar_type() == history.scalar_type() &&
                    queries[i].scalar_type() == history.scalar_type() &&
                    coefficients[i].scalar_type() == history.scalar_type(),
                "train_read_entry_gradients: inconsistent shapes or dtypes");
    entries[i] = coefficients[i].size(0);
  }
  AT_DISPATCH_FLOATING_TYPES(history.scalar_type(), "train_read_entry_gradients", [&] {
    std::vector<const scalar_t*> g(reads), q(reads), c(reads);
    for (int64_t i = 0; i < reads; ++i) {
      g[i] = grads_u[i].data_ptr<scalar_t>();
      q[i] = queries[i].data_ptr<scalar_t>();
      c[i] = coefficients[i].data_ptr<scalar_t>();
    }
    entry_gradients_rows<scalar_t>(history.data_ptr<scalar_t>(), grad_entries.data_ptr<scalar_t>(), g, q, c, entries,
                                   key_streams, rows, streams, hidden);
  });
}

// Backward of the write P' = lerp(swap(P), P, rho) + beta * y (two streams; P absent at a block's first branch,
// P' = beta * y): dL/dP = lerp(swap(g), g, rho), dL/drho = sum (g - swap g) . P, dL/dbeta = sum_tokens g * y,
// dL/dy = sum_j g^j beta^j in y's dtype.
template <typename state_t, typename y_t>
void write_backward_rows(const state_t* grad, const state_t* partial, state_t rho, const state_t* beta,
                         const y_t* written, int64_t rows, int64_t streams, int64_t hidden, state_t* grad_partial,
                         state_t* chunk_rho, state_t* chunk_beta, y_t* grad_written) {
  const int64_t chunks = chunk_count(rows);
  const int64_t grain = std::max<int64_t>(1, row_grain(streams * hidden) / kChunkRows);
  const bool low = rho < 0.5;  // torch.lerp's two forms, by the weight
  at::parallel_for(0, chunks, grain, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<state_t> gy(hidden);
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      state_t* gb = chunk_beta + chunk * streams * hidden;
      std::fill_n(gb, streams * hidden, state_t(0));
      state_t grad_rho = 0;
      for (int64_t r = chunk * kChunkRows; r < std::min(rows, (chunk + 1) * kChunkRows); ++r) {
        const y_t* y = written + r * hidden;
        std::fill_n(gy.data(), hidden, state_t(0));
        for (int64_t j = 0; j < streams; ++j) {
          const state_t* g = grad + (r * streams + j) * hidden;
          const state_t* b = beta + j * hidden;
          state_t* gbj = gb + j * hidden;
#pragma omp simd
          for (int64_t d = 0; d < hidden; ++d) {
            gbj[d] += g[d] * static_cast<state_t>(y[d]);
            gy[d] += g[d] * b[d];
          }
          if (partial == nullptr) continue;
          const state_t* other = grad + (r * streams + 1 - j) * hidden;  // two streams: swap(g)^j = g^{1-j}
          const state_t* p = partial + (r * streams + j) * hidden;
          state_t* o = grad_partial + (r * streams + j) * hidden;
          state_t dot = 0;
          if (low) {
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < hidden; ++d) {
              o[d] = other[d] + rho * (g[d] - other[d]);
              dot += (g[d] - other[d]) * p[d];
            }
          } else {
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < hidden; ++d) {
              o[d] = g[d] - (g[d] - other[d]) * (1 - rho);
              dot += (g[d] - other[d]) * p[d];
            }
          }
          grad_rho += dot;
        }
        y_t* out = grad_written + r * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) out[d] = to_branch_dtype<y_t>(gy[d]);
      }
      chunk_rho[chunk] = grad_rho;
    }
  });
}

std::vector<at::Tensor> write_backward(const at::Tensor& grad, const std::optional<at::Tensor>& partial,
                                       const std::optional<at::Tensor>& rho, const at::Tensor& beta,
                                       const at::Tensor& written) {
  TORCH_CHECK(grad.dim() == 4 && grad.is_contiguous() && beta.is_contiguous() && written.is_contiguous() &&
                  beta.scalar_type() == grad.scalar_type(),
              "write_backward: contiguous grad [B, T, J, D], beta [J, D], y [B, T, D]");
  const int64_t batch = grad.size(0), tokens = grad.size(1), streams = grad.size(2), hidden = grad.size(3);
  const int64_t rows = batch * tokens;
  TORCH_CHECK(written.numel() == rows * hidden && beta.numel() == streams * hidden, "write_backward: inconsistent shapes");
  if (partial.has_value()) {
    TORCH_CHECK(streams == 2 && rho.has_value() && rho->numel() == 1 && partial->is_contiguous() &&
                    partial->sizes() == grad.sizes() && partial->scalar_type() == grad.scalar_type() &&
                    rho->scalar_type() == grad.scalar_type(),
                "write_backward: a transport needs two streams, rho (1,) and a contiguous partial shaped as grad");
  }
  const int64_t chunks = chunk_count(rows);
  auto options = grad.options();
  at::Tensor grad_partial = at::empty({partial.has_value() ? batch : 0, tokens, streams, hidden}, options);
  at::Tensor chunk_rho = at::empty({chunks}, options);
  at::Tensor chunk_beta = at::empty({chunks, streams, hidden}, options);
  at::Tensor grad_written = at::empty({batch, tokens, hidden}, options.dtype(written.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "write_backward", [&] {
    using state_t = scalar_t;
    const state_t r = partial.has_value() ? *rho->data_ptr<state_t>() : state_t(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, written.scalar_type(), "write_backward_y", [&] {
      write_backward_rows<state_t, scalar_t>(
          grad.data_ptr<state_t>(), partial.has_value() ? partial->data_ptr<state_t>() : nullptr, r,
          beta.data_ptr<state_t>(), written.data_ptr<scalar_t>(), rows, streams, hidden,
          partial.has_value() ? grad_partial.data_ptr<state_t>() : nullptr, chunk_rho.data_ptr<state_t>(),
          chunk_beta.data_ptr<state_t>(), grad_written.data_ptr<scalar_t>());
    });
  });
  return {grad_partial, sum_chunks(chunk_rho.reshape({chunks, 1})), sum_chunks(chunk_beta), grad_written};
}
"""

_FUNCTIONS = [
    "commit", "phase_one", "read_partial", "write_first", "write_partial", "train_read", "train_read_backward",
    "train_read_entry_gradients", "write_backward", "read_sources", "read_sources_backward",
]
_loaded: dict[str, object] = {}  # "module" -> the built extension, or None after a failed build


def _host_cpu() -> str:
    """What identifies this CPU's instruction set: the flags line of /proc/cpuinfo (Linux), else the platform's names."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _host_vector_flags() -> list[str]:
    """-march=native on x86-64 Linux (AVX2 / AVX-512 for the depth products: phase 1 runs 2.5-3x faster than on the SSE2 baseline),
    where GCC and Clang both take it; the portable baseline elsewhere."""
    return ["-march=native"] if sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") else []


def _host_parallel_flags() -> list[str]:
    """-fopenmp on Linux, where the rows run on torch's own OpenMP runtime (the kernels link no other: its symbols
    resolve to the libgomp that libtorch_cpu loads, so `torch.set_num_threads` governs them); elsewhere (Apple's
    clang takes no -fopenmp) only the vector loops' pragmas, and every call runs on the calling thread."""
    return ["-fopenmp"] if sys.platform == "linux" else ["-fopenmp-simd"]


def cpu_kernels():
    """The built extension (functions as in the module docstring), or None where it cannot be built (warned once)."""
    if "module" not in _loaded:
        from torch.utils.cpp_extension import load_inline  # imports setuptools: only when the kernels are asked for

        flags = ["-O3", *_host_parallel_flags(), *_host_vector_flags()]
        # One build per source, flags, host CPU, torch version and installation: venvs (and machines) sharing the
        # extensions folder (~/.cache) do not rebuild, or run, each other's.
        key = f"{_SOURCE}{flags}{_host_cpu()}{torch.__version__}{torch.__file__}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        logger.info("Loading DAR's CPU kernels (built on first use: about 40 s on two cores).")
        try:
            _loaded["module"] = load_inline(
                name=f"dar_cpu_kernels_{digest}", cpp_sources=_SOURCE, functions=_FUNCTIONS, extra_cflags=flags,
            )
        except Exception as error:  # no compiler, no ninja, a failed build: the PyTorch operations run instead
            logger.warning(
                "dar_inference_kernel='cpp' / dar_training_kernel='cpp': DAR's CPU kernels could not be built, so "
                f"the PyTorch operations run instead (same results, slower). {type(error).__name__}: {error}"
            )
            _loaded["module"] = None
    return _loaded["module"]


__all__ = ["cpu_kernels"]
