"""The staleness_training study aggregating hand-made sweeps (``hand.hand_sweeps``)."""
import pytest

from lab.studies.staleness_training.tests.hand import hand_sweeps


@pytest.fixture
def hand_study():
    """(results, summary) of the study aggregating hand-made sweeps with the given final J at N = 64."""
    from lab.studies.staleness_training import study

    def make(sync64_vespo, sync64_ppo):
        cfg = study.Config(estimators=["ppo_clip", "vespo"], minibatches=[4, 64], seeds=[0, 1, 2, 3], etas=[],
                           noise_levels=[0.0, 0.5], n_boot=200)
        return study.aggregate(cfg, hand_sweeps(sync64_vespo, sync64_ppo))

    return make
