"""A family added from the tests folder only (no edit under `vidray/`): Wan's tiny transformer under another name,
with bucket rules of its own (sides multiples of 32), planned by measuring (no planner facts).

`TOY_CARD` is what a user writes for a new family; the tests register it in-process (`register_card`) or name it
in `VIDRAY_FAMILY_CARDS=toy_family:TOY_CARD` for other processes (with this folder on PYTHONPATH).
"""

from vidray.cards import BucketRules, FamilyCard
from vidray.models.wan import WanFamily


class ToyFamily(WanFamily):
    name = "toy"
    example_bucket = (5, 32, 32)


TOY_CARD = FamilyCard(
    name="toy", family_class="toy_family:ToyFamily",
    bucket_rules=BucketRules(spatial_multiple=32, temporal_compression=4), objective="flow_matching",
    text_seq_len=32, pipelines={"ToyPipeline": False}, blocks="blocks",
)
