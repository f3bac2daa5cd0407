"""What an hour of a TPU chip or of a GPU costs: a dated table of public list prices (on-demand, each with
the page it comes from), and the user's own prices, which replace them (the form's "Prices" box, the
command line's `--price tpu-v5p=4.2,h100-sxm=3.99` or `--prices-file`).

The table prices TPUs per chip-hour (a slice costs its chips times that) and GPUs per GPU-hour (a VM of
eight costs eight times that, its host's CPUs, memory and disks included). The figures come from public
machine-readable catalogs built from the providers' pricing APIs; the quoted lines, and the prices not
adopted, are in bench/prices_candidates.json. Google Cloud's us-central1 list prices where it rents the
chip, so that the two sides of a comparison are priced alike; elsewhere the provider named. No price is
known for TPU7x, V100, T4, A10, RTX 4090, H100 PCIe and H100 NVL: the comparison gives their cost as n/a
and says how to supply one.

No JAX here: the configuration layer validates prices.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from migration.common import ConfigError, one_of, shown
from migration.hardware import GPU_SPECS, TPU_CHIPS, TpuSpec

PRICES_AS_OF = "2026-12-02"  # when the table's sources were read
_SKYPILOT = ("https://github.com/skypilot-org/skypilot-catalog/blob/006059e0f18acb1341e22a27751e9f80df6ba92f/"
             "catalogs/v8/gcp/vms.csv")
_CYCLENERD = ("https://github.com/Cyclenerd/google-cloud-pricing-cost-calculator/blob/"
              "dac31281f2a4575f0a8bff20ac04fc71a5ff2190/pricing.yml")
_AZURE = ("https://github.com/skypilot-org/skypilot-catalog/blob/098741e70562f65d7af1cceb81e33b284f742604/"
          "catalogs/v6/azure/vms.csv")
_AWS = ("https://github.com/skypilot-org/skypilot-catalog/blob/00148f2af3672e2229b4f7bf8157d5a3f36e3c35/"
        "catalogs/v8/aws/vms.csv")
MAX_USD_PER_HOUR = 10_000.0  # per chip or GPU: far above any list price; a larger figure is a typo
PRICES_TEXT_MAX = 600


@dataclasses.dataclass(frozen=True)
class Price:
    key: str  # "tpu-v5p" (a TPU generation, per chip-hour) or a GPU catalog key (per GPU-hour)
    usd_per_hour: float
    source: str  # the page the figure comes from, or "yours" for a user's price
    as_of: str  # when it was read (the catalog's own date where it states one)
    note: str = ""  # provider, region and how the figure was derived

    @property
    def unit(self) -> str:
        return "chip-hour" if is_tpu_key(self.key) else "GPU-hour"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "unit": self.unit}


def tpu_price_key(generation: str) -> str:
    """The price table's key of a TPU generation: "tpu-v5p", "tpu7x"."""
    return generation if generation.startswith("tpu") else f"tpu-{generation}"


def is_tpu_key(key: str) -> bool:
    return key in {tpu_price_key(g) for g in TPU_CHIPS}


def price_keys() -> tuple[str, ...]:
    """Every key a price may be given for: the TPU generations, the catalog GPUs, and `local` (this
    machine's GPUs, when the plan targets them)."""
    return (*(tpu_price_key(g) for g in TPU_CHIPS), *GPU_SPECS, "local")


_GCP_TPU = "Google Cloud, on-demand, us-central1"
PRICES: dict[str, Price] = {p.key: p for p in [
    Price("tpu-v3", 2.00, _SKYPILOT, "catalog snapshot read 2026-12-02",
          f"{_GCP_TPU}: tpu-v3-8 (4 chips) at $8.00/hour"),
    Price("tpu-v4", 3.22, _SKYPILOT, "catalog snapshot read 2026-12-02",
          "Google Cloud, on-demand, us-central2 (v4's region): tpu-v4-8 (4 chips) at $12.88/hour"),
    Price("tpu-v5e", 1.20, _SKYPILOT, "catalog snapshot read 2026-12-02",
          f"{_GCP_TPU}: tpu-v5litepod-1 (1 chip) at $1.20/hour; v5litepod-8 at $9.60"),
    Price("tpu-v5p", 4.20, _SKYPILOT, "catalog snapshot read 2026-12-02",
          f"{_GCP_TPU}: tpu-v5p-12288 (6,144 chips) at $25,804.80/hour"),
    Price("tpu-v6e", 2.70, _SKYPILOT, "catalog snapshot read 2026-12-02",
          f"{_GCP_TPU}: tpu-v6e-1 (1 chip) at $2.70/hour; v6e-256 at $691.20"),
    Price("h100-sxm", 11.0612, _CYCLENERD, "2026-08-20",
          "Google Cloud, on-demand, us-central1: a3-highgpu-8g (8 x H100 80GB, 208 vCPU, 1,872 GB) at $88.49/hour"),
    Price("h200", 10.845, _SKYPILOT, "catalog snapshot read 2026-12-02",
          "Google Cloud, on-demand, us-central1: a3-ultragpu-8g (8 x H200), host $12.27 + GPUs $74.49 per hour; "
          "low confidence (this catalog's GPU rows disagree with Google's SKU prices elsewhere): check it"),
    Price("a100-40gb", 3.673385, _CYCLENERD, "2026-08-20",
          "Google Cloud, on-demand, us-central1: a2-highgpu-8g (8 x A100 40GB) at $29.39/hour"),
    Price("a100-80gb", 5.0688, _CYCLENERD, "2026-08-20",
          "Google Cloud, on-demand, us-central1: a2-ultragpu-8g (8 x A100 80GB) at $40.55/hour"),
    Price("l4", 0.706832, _CYCLENERD, "2026-08-20",
          "Google Cloud, on-demand, us-central1: g2-standard-4 (1 x L4, 4 vCPU, 16 GB)"),
    Price("a10g", 1.006, _AWS, "catalog snapshot read 2026-12-02",
          "AWS, on-demand, us-east-1: g5.xlarge (1 x A10G, 4 vCPU, 16 GB) at $1.006/hour (Google Cloud rents no A10G)"),
    Price("l40s", 2.62316, _AWS, "catalog snapshot read 2026-12-02",
          "AWS, on-demand, us-east-1: g6e.12xlarge (4 x L40S) at $10.49264/hour (Google Cloud rents no L40S)"),
    Price("a100-80gb-pcie", 3.673, _AZURE, "catalog snapshot read 2026-12-02",
          "Azure, pay-as-you-go, eastus: Standard_NC24ads_A100_v4 (1 x A100 80GB PCIe)"),
]}


def parse_prices(value: Any, field: str = "prices") -> dict[str, float]:
    """Prices as the form and `--price` give them: "key=dollars" pairs separated by commas (or spaces), e.g.
    "tpu-v5p=4.2, h100-sxm=3.99"; "" for none. Each key one of `price_keys()`, each price a positive number
    of dollars per chip-hour (TPU) or GPU-hour (GPU) up to MAX_USD_PER_HOUR. One line naming the bad pair
    otherwise."""
    if not isinstance(value, str) or len(value) > PRICES_TEXT_MAX or "\n" in value:
        raise ConfigError(field, f"must be one line of key=dollars pairs, at most {PRICES_TEXT_MAX} characters, "
                                 f"e.g. tpu-v5p=4.2,h100-sxm=3.99; got {shown(value)}")
    prices: dict[str, float] = {}
    for pair in (p for p in re.split(r"[,\s]+", value.strip()) if p):
        key, sep, amount = pair.partition("=")
        key = checked_key(key, field, pair, sep)  # the key first: a bad key is named as such
        prices[key] = checked_price(amount, field, key)
    return prices


def checked_key(key: str, field: str, pair: str = "", sep: str = "=") -> str:
    if not sep:
        raise ConfigError(field, f"each price is key=dollars per hour, e.g. tpu-v5p=4.2; got {shown(pair)}")
    if key not in price_keys():
        raise ConfigError(field, f"{shown(key)} has no price: the keys are {one_of(price_keys())}")
    return key


def checked_price(amount: Any, field: str, key: str) -> float:
    """A price: a positive, finite number of dollars per hour (text or number), at most MAX_USD_PER_HOUR."""
    try:
        usd = float(amount) if isinstance(amount, (int, float, str)) and not isinstance(amount, bool) else math.nan
    except ValueError:
        usd = math.nan
    if not (math.isfinite(usd) and 0 < usd <= MAX_USD_PER_HOUR):
        unit = "chip-hour" if is_tpu_key(key) else "GPU-hour"
        raise ConfigError(field, f"{key}: a price must be a positive number of dollars per {unit} up to "
                                 f"{MAX_USD_PER_HOUR:,.0f}; got {shown(amount)}")
    return usd


def read_prices_file(path: str | Path, field: str = "prices_file") -> dict[str, float]:
    """A file of prices: JSON ({"tpu-v5p": 4.2, "h100-sxm": 3.99}) or text with one key=dollars (or
    key,dollars) per line; '#' starts a comment. Checked as `parse_prices`."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="strict")[:100_000]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, f"{path}: could not be read ({getattr(exc, 'strerror', None) or type(exc).__name__})")
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(field, f"{path}: not valid JSON ({exc})")
        if not isinstance(data, dict):
            raise ConfigError(field, f"{path}: must map keys to dollars per hour, e.g. {{\"tpu-v5p\": 4.2}}")
        return {k: checked_price(v, field, k) for k, v in data.items() if checked_key(k, field, k)}
    prices: dict[str, float] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, sep, amount = line.replace(",", "=", 1).partition("=")
            key = checked_key(key.strip(), field, line, sep)
            prices[key] = checked_price(amount.strip(), field, key)
    return prices


def fmt_prices(prices: dict[str, float]) -> str:
    """Prices as `parse_prices` reads them."""
    return ",".join(f"{k}={v:g}" for k, v in prices.items())


def tpu_price(source: TpuSpec, given: dict[str, float]) -> Price | None:
    """The price of one chip-hour of the source's TPU generation: the user's, else the table's."""
    return _price(tpu_price_key(source.generation), given)


def gpu_price(key: str, given: dict[str, float], device_key: str | None = None) -> Price | None:
    """The price of one GPU-hour of the target (`key`: a catalog key or "local", which takes the catalog
    entry of this machine's device, `device_key`, where there is one): the user's, else the table's."""
    if key == "local" and "local" not in given and device_key:
        key = device_key
    return _price(key, given)


def _price(key: str, given: dict[str, float]) -> Price | None:
    if key in given:
        return Price(key, given[key], "yours", "given with the plan")
    return PRICES.get(key)
