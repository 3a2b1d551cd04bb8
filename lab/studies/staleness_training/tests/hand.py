"""Hand-made sweeps of the staleness_training study: (steps, runs) tables as lab.engine.sweep.load_results reads
them."""
import pandas as pd


def hand_sweeps(sync64_vespo, sync64_ppo):
    """{study: (steps, runs)}: 4 seeds of ppo_clip and vespo at N = 4 and 64 (final J 0.5 everywhere at N = 4) and a
    mismatch study; two rollouts of one update each, J = 0.25 after the first and the final J after the second; only
    the second rollout samples a reward."""
    def sweep(setting, finals):
        runs, steps = [], []
        for (e, x), fs in finals.items():
            for seed, f in enumerate(fs):
                runs.append({"estimator": e, setting: x, "seed": seed, "env": "tiny_target", "final_reward": f,
                             "collapsed": False})
                steps += [{"estimator": e, setting: x, "seed": seed, "rollout": r, "update": r + 1,
                           "expected_reward": j, "sampled_reward": s}
                          for r, (j, s) in enumerate([(0.25, 0.0), (f, 1.0)])]
        return pd.DataFrame(steps), pd.DataFrame(runs)

    half = [0.5] * 4
    sync = {("ppo_clip", 4): half, ("ppo_clip", 64): sync64_ppo, ("vespo", 4): half, ("vespo", 64): sync64_vespo}
    mismatch = {("ppo_clip", 0.0): half, ("ppo_clip", 0.5): [0.0, 0.0, 0.1, 0.1], ("vespo", 0.0): half,
                ("vespo", 0.5): [0.4, 0.4, 0.5, 0.5]}
    return {"sync": sweep("minibatches", sync), "mismatch": sweep("logprob_noise", mismatch)}
