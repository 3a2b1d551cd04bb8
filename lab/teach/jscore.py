"""The JavaScript twin of the lessons' numpy cores, inlined into every browser page (lab.teach.pages).

``SOURCE`` defines ``window.TeachCore`` with one object per lesson whose ``pageData(params, grids)`` returns the
same dict as the Python ``page_data`` of that lesson (lab.teach.weight_explosion, clip_mask, vespo_kernel,
gvpo_zero_sum, vopd_baseline, sampler_truncation), from the same formulas, the same random streams
(lab.teach.hashrng), the same fixed-step bisection (lab.teach.tokens) and the same kept sets
(lab.policies.truncation.kept_set, vLLM's rules). The page tests evaluate both in headless Chromium and compare them
number by number. Registry hyper-parameters (clip ranges, caps, VESPO's defaults, the ratio band) are not repeated
here: the pages pass the registry's values in ``params``.
"""

SOURCE = r"""
window.TeachCore = (function () {
  "use strict";

  // ---- hashrng: lowbias32 counter-based draws (lab/teach/hashrng.py) ----
  function mix32(x) {
    x = x >>> 0;
    x = (x ^ (x >>> 16)) >>> 0;
    x = Math.imul(x, 0x7feb352d) >>> 0;
    x = (x ^ (x >>> 15)) >>> 0;
    x = Math.imul(x, 0x846ca68b) >>> 0;
    return (x ^ (x >>> 16)) >>> 0;
  }
  function uniforms(seed, n, offset) {
    const key = mix32(seed >>> 0), out = new Array(n);
    for (let i = 0; i < n; i++) out[i] = (mix32((key + (offset || 0) + i) >>> 0) + 0.5) / 4294967296;
    return out;
  }
  function normals(seed, n) {
    const u = uniforms(seed, 2 * n, 0), out = new Array(n);
    for (let j = 0; j < n; j++) out[j] = Math.sqrt(-2 * Math.log(u[2 * j])) * Math.cos(2 * Math.PI * u[2 * j + 1]);
    return out;
  }

  // ---- vectors ----
  const sum = (a) => a.reduce((s, x) => s + x, 0);
  const dot = (a, b) => a.reduce((s, x, i) => s + x * b[i], 0);
  const norm = (a) => Math.sqrt(dot(a, a));
  const exp = (a) => a.map(Math.exp);
  function logSoftmax(z) {
    const m = Math.max(...z), ls = Math.log(sum(z.map((x) => Math.exp(x - m))));
    return z.map((x) => x - m - ls);
  }
  function kl(logP, logQ) {  // sum p (log p - log q), 0 log 0 = 0
    let s = 0;
    for (let i = 0; i < logP.length; i++) { const p = Math.exp(logP[i]); if (p > 0) s += p * (logP[i] - logQ[i]); }
    return s;
  }
  function logSumExp(x) { const m = Math.max(...x); return m + Math.log(sum(x.map((v) => Math.exp(v - m)))); }

  // ---- tokens: pi and a stale mu at a per-token KL (lab/teach/tokens.py) ----
  const logits = (V, seed, sharpness) => normals(2 * seed, V).map((x) => sharpness * x);
  function direction(V, seed) {
    let e = normals(2 * seed + 1, V);
    const m = sum(e) / V;
    e = e.map((x) => x - m);
    const rms = Math.sqrt(sum(e.map((x) => x * x)) / V);
    return e.map((x) => x / rms);
  }
  function behaviourScale(z, e, target) {
    const logPi = logSoftmax(z);
    const klAt = (s) => kl(logSoftmax(z.map((x, i) => x + s * e[i])), logPi);
    let hi = 1;
    for (let i = 0; i < 64 && klAt(hi) < target && hi < 1e4; i++) hi *= 2;
    let lo = 0;
    for (let i = 0; i < 100; i++) {
      const mid = 0.5 * (lo + hi);
      if (klAt(mid) < target) lo = mid; else hi = mid;
    }
    return 0.5 * (lo + hi);
  }
  function stalePair(V, target, seed, sharpness) {
    const z = logits(V, seed, sharpness), e = direction(V, seed), s = behaviourScale(z, e, target);
    return { logPi: logSoftmax(z), logMu: logSoftmax(z.map((x, i) => x + s * e[i])) };
  }

  // ---- why sequence weights explode (lab/teach/weight_explosion.py) ----
  function tokenStats(logPi, logMu) {
    const mu = exp(logMu), lr = logPi.map((x, i) => x - logMu[i]);
    const mean = dot(mu, lr);
    return { kl_mu_pi: -mean, kl_pi_mu: kl(logPi, logMu),
             chi2: sum(lr.map((x, i) => Math.exp(Math.min(logMu[i] + 2 * x, 700)))) - 1,
             var_log_rho: Math.max(dot(mu, lr.map((x) => x * x)) - mean * mean, 0) };
  }
  function sequenceStats(tok, T) {
    const logM2 = T * Math.log1p(tok.chi2);
    return { kl_seq: T * tok.kl_mu_pi, chi2_seq: Math.expm1(logM2), ess_frac: Math.exp(-logM2),
             var_log_w: T * tok.var_log_rho };
  }
  const weightExplosion = {
    pageData(p, g) {
      const pair = stalePair(p.vocab, p.kl, p.seed, p.sharpness), tok = tokenStats(pair.logPi, pair.logMu);
      const seq = g.lengths.map((T) => sequenceStats(tok, T));
      return { token: tok, lengths: g.lengths, ess_frac: seq.map((s) => s.ess_frac),
               chi2_seq: seq.map((s) => s.chi2_seq), var_log_w: seq.map((s) => s.var_log_w),
               at_length: sequenceStats(tok, p.length) };
    },
  };

  // ---- what clipping and masking throw away (lab/teach/clip_mask.py) ----
  const sigmoid = (x) => 1 / (1 + Math.exp(-x));
  const COEF = {  // effective coefficient on A grad log pi, the registry's formulas (hyper-parameters passed in)
    token_is: (r) => r,
    ppo_clip: (r, a, h) => {
      let pass = a >= 0 ? r < 1 + h.clip_ratio_high : r > 1 - h.clip_ratio_low;
      if (h.clip_ratio_c !== null && h.clip_ratio_c !== undefined && a < 0 && r > h.clip_ratio_c) pass = false;
      return pass ? r : 0;
    },
    tis_token: (r, a, h) => Math.min(r, h.cap),
    mis_token: (r, a, h) => (r >= h.lower && r <= h.upper ? r : 0),
    cispo: (r, a, h) => {
      const rr = Math.exp(Math.min(Math.max(Math.log(r), -20), 20));
      return Math.min(Math.max(rr, 1 - h.clip_ratio_low), 1 + h.clip_ratio_high);
    },
    sapo: (r, a, h) => {
      const s = sigmoid((a > 0 ? h.tau_pos : h.tau_neg) * (r - 1));
      return Math.abs(Math.log(r)) <= 20 ? 4 * s * (1 - s) * r : 0;
    },
  };
  function advantages(logPi, seed) {
    const R = normals(1000000 + seed, logPi.length), m = dot(exp(logPi), R);
    return R.map((x) => x - m);
  }
  function expectedGradient(pi, mu, adv, coef) {
    const a = mu.map((m, i) => m * coef[i] * adv[i]), s = sum(a);
    return a.map((x, i) => x - pi[i] * s);
  }
  function losses(logPi, logMu, adv, coef) {
    const pi = exp(logPi), mu = exp(logMu), ratio = logPi.map((x, i) => Math.exp(Math.min(x - logMu[i], 700)));
    const gTrue = expectedGradient(pi, mu, adv, ratio), g = expectedGradient(pi, mu, adv, coef);
    const nT = norm(gTrue), n = norm(g), unit = gTrue.map((x) => x / Math.max(nT, 1e-300));
    const lost = gTrue.map((x, i) => x - g[i]), along = dot(lost, unit);
    const across = norm(lost.map((x, i) => x - along * unit[i]));
    let zeroed = 0, removed = 0, mass = 0;
    for (let i = 0; i < pi.length; i++) {
      if (coef[i] === 0 && ratio[i] > 0) zeroed += mu[i];
      removed += mu[i] * Math.abs(adv[i]) * Math.max(ratio[i] - coef[i], 0);
      mass += mu[i] * Math.abs(adv[i]) * ratio[i];
    }
    return { zeroed, mass_lost: removed / mass, cos: n > 0 ? dot(g, gTrue) / Math.max(n * nT, 1e-300) : 0,
             norm_ratio: n / nT, lost_along: along / nT, lost_across: across / nT, rel_bias: norm(lost) / nT };
  }
  const clipMask = {
    pageData(p, g) {
      const one = (kl) => {
        const pair = stalePair(p.vocab, kl, p.seed, p.sharpness), adv = advantages(pair.logPi, p.seed);
        const ratio = pair.logPi.map((x, i) => Math.exp(Math.min(x - pair.logMu[i], 700))), coef = {}, out = {};
        for (const m of p.methods) {
          coef[m] = ratio.map((r, i) => COEF[m](r, adv[i], p.hyper[m] || {}));
          out[m] = losses(pair.logPi, pair.logMu, adv, coef[m]);
        }
        return { pair, adv, ratio, coef, out };
      };
      const at = one(p.kl), grid = {};
      for (const m of p.methods) grid[m] = { cos: [], mass_lost: [], zeroed: [] };
      for (const kl of g.kl_grid) {
        const o = one(kl).out;
        for (const m of p.methods) for (const k of ["cos", "mass_lost", "zeroed"]) grid[m][k].push(o[m][k]);
      }
      return { rho: at.ratio, advantage: at.adv, mu: exp(at.pair.logMu), coef: at.coef, at: at.out,
               kl_grid: g.kl_grid, grid };
    },
  };

  // ---- VESPO's kernel as a proposal (lab/teach/vespo_kernel.py) ----
  function logPhi(W, k, lam) {  // lam + k log W - lam W, with xlogy(0, 0) = 0
    const t = k === 0 ? 0 : (W === 0 ? -Infinity : k * Math.log(W));
    return lam + t - lam * W;
  }
  function boundConstant(k, lam) {
    if (k < 1) return Infinity;
    if (k === 1) return Math.exp(lam);
    return Math.exp((k - 1) * Math.log((k - 1) / lam) + lam - k + 1);
  }
  function enumerate(logPi, logMu, T) {
    let sm = logMu.slice(), sw = logPi.map((x, i) => x - logMu[i]);
    const lw = sw.slice();
    for (let t = 1; t < T; t++) {
      const nm = [], nw = [];
      for (let a = 0; a < sm.length; a++) for (let b = 0; b < logMu.length; b++) {
        nm.push(sm[a] + logMu[b]); nw.push(sw[a] + lw[b]);
      }
      sm = nm; sw = nw;
    }
    return { logMuSeq: sm, logW: sw };
  }
  const kernelLog = (logW, k, lam) => logW.map((x) => logPhi(Math.exp(Math.min(Math.max(x, -745), 700)), k, lam));
  function proposal(logMuSeq, logW, k, lam) {
    const lphi = kernelLog(logW, k, lam);
    const logZ = logSumExp(logMuSeq.map((x, i) => x + lphi[i]));
    const logQ = logMuSeq.map((x, i) => x + lphi[i] - logZ);
    const q = exp(logQ), mu = exp(logMuSeq), pi = logMuSeq.map((x, i) => Math.exp(x + logW[i]));
    const logC = logSumExp(logQ.map((x, i) => x + logW[i]));
    const logPhi2 = logSumExp(logMuSeq.map((x, i) => x + 2 * lphi[i]));
    const K = boundConstant(k, lam);
    const meanMu = dot(mu, logW), meanQ = dot(q, logW), meanPi = dot(pi, logW), gap = meanPi - meanMu;
    let klQMu = 0, klQPi = 0;
    for (let i = 0; i < q.length; i++) if (q[i] > 0) {
      klQMu += q[i] * (logQ[i] - logMuSeq[i]); klQPi += q[i] * (logQ[i] - logMuSeq[i] - logW[i]);
    }
    return { Z: Math.exp(logZ), C: Math.exp(logC), phi2: Math.exp(logPhi2), K, bound: Math.exp(logZ + logC) * K,
             ratio: isFinite(K) ? Math.exp(logPhi2 - logZ - logC) / K : 0, kl_q_mu: klQMu, kl_q_pi: klQPi,
             mean_logw_mu: meanMu, mean_logw_q: meanQ, mean_logw_pi: meanPi,
             position: gap > 1e-9 ? (meanQ - meanMu) / gap : NaN,
             ess_vespo: Math.exp(2 * logZ - logPhi2), ess_is: Math.exp(-logSumExp(logMuSeq.map((x, i) => x + 2 * logW[i]))) };
  }
  function histograms(logMuSeq, logW, k, lam, edges) {
    const lphi = kernelLog(logW, k, lam), logZ = logSumExp(logMuSeq.map((x, i) => x + lphi[i]));
    const n = edges.length - 1, out = { mu: new Array(n).fill(0), q: new Array(n).fill(0), pi: new Array(n).fill(0) };
    for (let i = 0; i < logW.length; i++) {
      let b = 0;
      while (b < n - 1 && logW[i] >= edges[b + 1]) b++;
      out.mu[b] += Math.exp(logMuSeq[i]); out.q[b] += Math.exp(logMuSeq[i] + lphi[i] - logZ);
      out.pi[b] += Math.exp(logMuSeq[i] + logW[i]);
    }
    return out;
  }
  const vespoKernel = {
    pageData(p, g) {
      const pair = stalePair(p.vocab, p.kl, p.seed, p.sharpness), en = enumerate(pair.logPi, pair.logMu, p.length);
      const K = boundConstant(p.k, p.lam);
      return { summary: proposal(en.logMuSeq, en.logW, p.k, p.lam), edges: g.edges,
               hist: histograms(en.logMuSeq, en.logW, p.k, p.lam, g.edges), log_w_grid: g.log_w_grid,
               phi: g.log_w_grid.map((x) => Math.exp(logPhi(Math.exp(x), p.k, p.lam))),
               k_w: isFinite(K) ? g.log_w_grid.map((x) => K * Math.exp(x)) : null };
    },
  };

  // ---- GVPO's zero-sum trick (lab/teach/gvpo_zero_sum.py) ----
  function gvpoProblem(n, seed, sharpness) {
    return { logRef: logSoftmax(logits(n, seed, sharpness)), reward: uniforms(2000000 + seed, n, 0) };
  }
  function sampler(name, logRef, reward, logPi) {
    const n = logRef.length;
    if (name === "on-policy") return exp(logPi);
    if (name === "reference") return exp(logRef);
    if (name === "uniform") return new Array(n).fill(1 / n);
    if (name === "low-reward") return exp(logSoftmax(reward.map((r) => -3 * r)));
    if (name === "partial") {
      let best = 0;
      for (let i = 1; i < n; i++) if (reward[i] > reward[best]) best = i;
      const mu = new Array(n).fill(1); mu[best] = 0;
      return mu.map((x) => x / (n - 1));
    }
    throw new Error("unknown sampler " + name);
  }
  const tv = (logP, logQ) => 0.5 * sum(logP.map((x, i) => Math.abs(Math.exp(x) - Math.exp(logQ[i]))));
  function trainExpected(logRef, reward, beta, name, steps, lr, centred) {
    const target = logSoftmax(logRef.map((x, i) => x + reward[i] / beta));
    let theta = logRef.slice();
    const trace = [tv(logSoftmax(theta), target)];
    for (let t = 0; t < steps; t++) {
      const logPi = logSoftmax(theta), mu = sampler(name, logRef, reward, logPi);
      const u = logPi.map((x, i) => beta * (x - logRef[i]) - reward[i]);
      let grad;
      if (centred) {
        const m = dot(mu, u);
        grad = mu.map((w, i) => beta * w * (u[i] - m));
      } else {
        const b = mu.map((w, i) => w * u[i]), sb = sum(b);
        grad = b.map((x, i) => beta * (x - Math.exp(logPi[i]) * sb));
      }
      theta = theta.map((x, i) => x - (lr / (beta * beta)) * grad[i]);
      trace.push(tv(logSoftmax(theta), target));
    }
    return { tv: trace, logPi: logSoftmax(theta) };
  }
  const gvpoZeroSum = {
    pageData(p, g) {
      const pr = gvpoProblem(p.n, p.seed, p.sharpness);
      const target = logSoftmax(pr.logRef.map((x, i) => x + pr.reward[i] / p.beta));
      const out = { reward: pr.reward, ref: exp(pr.logRef), optimum: exp(target),
                    log_z: logSumExp(pr.logRef.map((x, i) => x + pr.reward[i] / p.beta)),
                    tv: {}, tv_uncentred: {}, final: {}, final_uncentred: {} };
      for (const s of g.samplers) {
        const a = trainExpected(pr.logRef, pr.reward, p.beta, s, p.steps, p.lr, true);
        const b = trainExpected(pr.logRef, pr.reward, p.beta, s, p.steps, p.lr, false);
        out.tv[s] = a.tv; out.final[s] = exp(a.logPi); out.tv_uncentred[s] = b.tv; out.final_uncentred[s] = exp(b.logPi);
      }
      return out;
    },
  };

  // ---- vOPD's baseline (lab/teach/vopd_baseline.py) ----
  function stateMoments(logP, logQ) {
    const p = exp(logP), r = logQ.map((x, i) => x - logP[i]), pp = dot(p, p);
    const s = p.map((x) => 1 - 2 * x + pp), value = dot(p, r);
    let eRs = 0, eS = 0, eR2s = 0, m2 = 0;
    for (let i = 0; i < p.length; i++) {
      eRs += p[i] * r[i] * s[i]; eS += p[i] * s[i]; eR2s += p[i] * r[i] * r[i] * s[i];
      const g = p[i] * (r[i] - value); m2 += g * g;
    }
    const var0 = eR2s - m2, varV = var0 - 2 * value * eRs + value * value * eS;
    return { value, b_star: eRs / eS, var_opd: var0, var_vopd: varV, var_best: var0 - (eRs * eRs) / eS,
             ratio: varV / var0, helps: varV < var0 ? 1 : 0, mean_norm: Math.sqrt(m2) };
  }
  function varianceCurve(logP, logQ, baselines) {
    const p = exp(logP), r = logQ.map((x, i) => x - logP[i]), pp = dot(p, p), value = dot(p, r);
    const s = p.map((x) => 1 - 2 * x + pp), m2 = sum(p.map((x, i) => (x * (r[i] - value)) ** 2));
    return baselines.map((b) => sum(p.map((x, i) => x * (r[i] - b) ** 2 * s[i])) - m2);
  }
  function randomPairs(V, draws, sharpness, closeness, seed) {
    const zs = normals(4000000 + seed, draws * V), noise = normals(3000000 + seed, draws * V), out = [];
    const c = Math.sqrt(1 - closeness * closeness);
    for (let d = 0; d < draws; d++) {
      const a = zs.slice(d * V, (d + 1) * V).map((x) => sharpness * x);
      const b = noise.slice(d * V, (d + 1) * V).map((x, i) => closeness * a[i] + c * sharpness * x);
      out.push({ logP: logSoftmax(a), logQ: logSoftmax(b) });
    }
    return out;
  }
  function median(a) {  // numpy's: the mean of the two middle values for an even count
    const s = a.slice().sort((x, y) => x - y), n = s.length;
    return n % 2 ? s[(n - 1) / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  }
  const vopdBaseline = {
    pageData(p, g) {
      const one = randomPairs(p.vocab, 1, p.sharpness, p.closeness, p.seed)[0], m = stateMoments(one.logP, one.logQ);
      const span = Math.max(Math.abs(m.value), Math.abs(m.b_star), 0.1) * 2.5, b = [];
      for (let i = 0; i <= 100; i++) b.push(-span + (2 * span * i) / 100);
      const frac = [], med = [];
      for (const V of g.vocabs) {
        const ms = randomPairs(V, p.draws, p.sharpness, p.closeness, p.seed).map((x) => stateMoments(x.logP, x.logQ));
        frac.push(sum(ms.map((x) => x.helps)) / ms.length);
        med.push(median(ms.map((x) => x.ratio)));
      }
      return { pair: m, p: exp(one.logP), q: exp(one.logQ), baselines: b,
               variance: varianceCurve(one.logP, one.logQ, b), vocabs: g.vocabs, helps_frac: frac, ratio_median: med };
    },
  };

  // ---- sampler truncation (lab/teach/sampler_truncation.py; the kept set of lab/policies/truncation.py) ----
  function softmax(z) {  // as torch: exp(z - max) / sum
    const m = Math.max(...z), e = z.map((x) => Math.exp(x - m)), s = sum(e);
    return e.map((x) => x / s);
  }
  function keptSet(z, kind, level) {  // vLLM's order min-p, top-k, top-p; settings that cut nothing are skipped
    const V = z.length;
    let keep = z.map((x) => x > -Infinity);
    const masked = () => z.map((x, i) => (keep[i] ? x : -Infinity));
    if (kind === "min_p" && level > 0) {
      const p = softmax(z), mx = Math.max(...p);
      keep = keep.map((k, i) => k && p[i] >= level * mx);
    }
    if (kind === "top_k" && Math.trunc(level) < V) {
      const kth = masked().slice().sort((a, b) => b - a)[Math.trunc(level) - 1];
      keep = keep.map((k, i) => k && z[i] >= kth);
    }
    if (kind === "top_p" && level < 1) {
      const p = softmax(masked()), ps = p.slice().sort((a, b) => a - b), cs = [];
      let c = 0;
      for (const x of ps) { c += x; cs.push(c); }
      const mx = Math.max(...p);
      keep = keep.map((k, i) => {
        let last = -1;  // the last of p[i]'s tie class in ascending order (searchsorted right - 1)
        for (let j = 0; j < ps.length && ps[j] <= p[i]; j++) last = j;
        return (k && !(cs[last] <= 1 - level)) || p[i] === mx;
      });
    }
    return keep;
  }
  function truncSetting(p, kind, level) {
    const z = logits(p.vocab, p.seed, p.sharpness);
    let zs = z;
    if (p.kl !== 0) {
      const e = direction(p.vocab, p.seed), s = behaviourScale(z, e, p.kl);
      zs = z.map((x, i) => x + s * e[i]);
    }
    const tempered = zs.map((x) => x / p.temperature), kept = keptSet(tempered, kind, level);
    const logMu = logSoftmax(tempered.map((x, i) => (kept[i] ? x : -Infinity)));
    const logM = logSumExp(z.map((x, i) => (kept[i] ? x : -Infinity))) - logSumExp(z);
    return { logPi: logSoftmax(z), logMu, kept, logM, reward: normals(1000000 + p.seed, p.vocab) };
  }
  function truncMeasures(s, p) {  // p.band: the ratio band; p.methods, p.hyper: the registry's
    const [lo, hi] = p.band, methods = p.methods, hyper = p.hyper;
    const pi = exp(s.logPi), mu = s.logMu.map((x, i) => (s.kept[i] ? Math.exp(x) : 0));
    const logPiS = s.logPi.map((x, i) => (s.kept[i] ? x - s.logM : -Infinity)), piS = exp(logPiS);
    const ratio = { plain: s.logPi.map((x, i) => (s.kept[i] ? Math.exp(x - s.logMu[i]) : 1)),
                    replay: logPiS.map((x, i) => (s.kept[i] ? Math.exp(x - s.logMu[i]) : 1)) };
    const R = s.reward, mR = dot(mu, R), adv = R.map((x) => x - mR);
    const truth = (q) => { const e = dot(q, R); return q.map((x, i) => x * R[i] - x * e); };
    const T = { full: truth(pi), deployed: truth(piS) };
    const unit = norm(T.full), rel = (g, t) => norm(g.map((x, i) => x - t[i])) / unit;  // units of |grad J(pi)|
    const out = (r) => dot(mu, r.map((x) => (x < lo || x > hi ? 1 : 0)));
    const res = { kept_mass: Math.exp(s.logM), kept_count: s.kept.filter((k) => k).length,
                  mean_ratio: dot(mu, ratio.plain), mean_ratio_replay: dot(mu, ratio.replay),
                  share_out: out(ratio.plain), share_out_replay: out(ratio.replay),
                  gap: rel(T.deployed, T.full), bias: {} };
    for (const m of methods) {
      res.bias[m] = {};
      for (const [key, score] of [["plain", pi], ["replay", piS]]) {
        const a = mu.map((w, i) => w * COEF[m](ratio[key][i], adv[i], hyper[m] || {}) * adv[i]), sa = sum(a);
        const g = a.map((x, i) => x - score[i] * sa);
        res.bias[m][key] = { full: rel(g, T.full), deployed: rel(g, T.deployed) };
      }
    }
    return res;
  }
  const samplerTruncation = {
    pageData(p, g) {
      const s = truncSetting(p, p.kind, p.level), grid = g[p.kind];
      const curves = { kept_mass: [], kept_count: [], mean_ratio: [], share_out: [], gap: [], share_out_replay: [],
                       bias: {} };
      for (const m of p.methods) curves.bias[m] = { plain: { full: [], deployed: [] }, replay: { full: [], deployed: [] } };
      for (const level of grid) {
        const r = truncMeasures(truncSetting(p, p.kind, level), p);
        for (const k of ["kept_mass", "kept_count", "mean_ratio", "share_out", "gap", "share_out_replay"]) curves[k].push(r[k]);
        for (const m of p.methods) for (const key of ["plain", "replay"]) for (const t of ["full", "deployed"])
          curves.bias[m][key][t].push(r.bias[m][key][t]);
      }
      return { pi: exp(s.logPi), mu: exp(s.logMu), kept: s.kept.map((k) => (k ? 1 : 0)),
               at: truncMeasures(s, p), grid, curves };
    },
  };

  return { mix32, uniforms, normals, logSoftmax, stalePair, COEF, weightExplosion, clipMask, vespoKernel,
           gvpoZeroSum, vopdBaseline, keptSet, samplerTruncation };
})();
"""
