"""The typed config loader: defaults, the shipped configs, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, KvmeshConfig, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_local_yaml_loads_and_describes_the_smollm2_layout():
    config = load_config(ROOT / "configs" / "local.yaml")
    layout = config.store_layout()
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (30, 3, 64)
    assert layout.page_tokens == config.cache.page_tokens == 16
    assert layout.page_bytes == 30 * 2 * 3 * 16 * 64 * 4


def test_empty_mapping_gives_defaults():
    assert config_from_dict({}) == KvmeshConfig()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"cache": {"page_tokn": 16}}, "unknown key 'cache.page_tokn'"),
        (
            {"modle": {}},
            "unknown key 'modle'; known: cache, compaction, model, requests, routing, security, "
            "service, store, workers",
        ),
        ({"requests": {"timeout_s": 0}}, "requests.timeout_s must be a positive number"),
        ({"requests": {"timeout_s": ".5"}}, "requests.timeout_s must be float, got '.5'"),
        ({"cache": {"page_tokens": "16"}}, "cache.page_tokens must be int, got '16'"),
        ({"cache": {"page_tokens": True}}, "cache.page_tokens must be int"),
        ({"cache": {"page_tokens": 0}}, "page_tokens must be positive, got 0"),
        ({"cache": {"eviction_policy": "fifo"}}, "known: deepest, lfu, lru"),
        ({"store": {"num_pages": -1}}, "store.num_pages must be positive, got -1"),
        ({"workers": {"share": "no"}}, "workers.share must be bool, got 'no'"),
        ({"store": {"dtype": "float32"}}, "'store.dtype' .the page store takes model.dtype"),
        ({"model": {"num_layers": 30}}, "the model's shape comes from the model itself"),
        ({"model": {"name": "gpt-9"}}, "model.name: unknown model 'gpt-9'; known: smollm2-135m"),
        ({"model": {"dtype": "int8"}}, "model.dtype must be one of float32, bfloat16"),
        ({"store": {"device": "cuda"}}, "store.device_pages must be a positive int, got 0"),
        ({"store": {"device": "tpu", "device_pages": 8}}, "store.device 'tpu': one of auto"),
        ({"store": {"device_pages": 8}}, "store.device_pages 8 needs store.device cuda or auto"),
        (
            {
                "store": {
                    "device": "auto",
                    "device_pages": 8,
                    "disk": {"enabled": True, "policy": "write_through"},
                }
            },
            "store.disk.policy write_through under store.device 'auto'",
        ),
        ({"store": {"disk": {"policy": "lazy"}}}, "store.disk.policy 'lazy': one of write_back"),
        ({"store": {"disk": {"pages": -3}}}, "store.disk.pages must be >= 0"),
        ({"store": {"disk": {"size": 3}}}, "unknown key 'store.disk.size'"),
        ({"store": {"disk": {"pages": 1 << 30}}}, "store.disk.pages is at most 131072"),
        ({"model": []}, "model must be a mapping, got list"),
        ({"compaction": {"policy": "lru"}}, "unknown compaction policy 'lru'; known: none, h2o"),
        ({"compaction": {"policy": "h2o", "params": {"recnt": 1}}}, "takes no parameter recnt"),
        ({"compaction": {"policy": "h2o", "budget": "half"}}, "compaction.budget must be"),
        ({"compaction": {"budget": [0.5, 0.5]}}, "2 per-layer values; smollm2-135m has 30"),
        ({"compaction": {"high_water": 1.5}}, "high_water must be in"),
        (
            {"routing": {"policy": "random"}},
            "routing.policy 'random' is not a policy; known: kvmesh",
        ),
        ([], "config must be a mapping"),
    ],
)
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config_from_dict(data)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  chunk_tokens: -4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: .*chunk_tokens must be >= 0, got -4"):
        load_config(bad)
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_a_metrics_port_beyond_loopback_needs_a_token():
    with pytest.raises(ConfigError, match="service.metrics_token"):
        config_from_dict({"service": {"metrics_host": "node"}})
    with pytest.raises(ConfigError, match="every interface"):
        config_from_dict({"service": {"metrics_host": "0.0.0.0", "metrics_token": "t"}})
    served = config_from_dict({"service": {"metrics_host": "node", "metrics_token": "t"}})
    assert served.service.metrics_host == "node"


def test_compaction_section_reaches_its_typed_config():
    config = config_from_dict(
        {
            "compaction": {
                "policy": "snapkv",
                "params": {"adaptive": True, "kernel": 5},
                "budget": [0.5] * 15 + [0.25] * 15,
                "high_water": 0.8,
            }
        }
    )
    compaction = config.compaction
    assert (compaction.policy, dict(compaction.params)) == (
        "snapkv",
        {"adaptive": True, "kernel": 5},
    )
    assert compaction.budget == (0.5,) * 15 + (0.25,) * 15 and compaction.high_water == 0.8
    assert config_from_dict({"compaction": {"budget": 64}}).compaction.budget == 64
    assert load_config(ROOT / "configs" / "local.yaml").compaction.policy == "none"


def test_tenant_figures_show_to_tokenless_clients_only_when_allowed():
    assert KvmeshConfig().server_config().metrics_show_tenants is False
    shown = config_from_dict({"service": {"metrics_show_tenants": True}})
    assert shown.server_config().metrics_show_tenants is True
    with pytest.raises(ConfigError, match="service.metrics_show_tenants must be bool"):
        config_from_dict({"service": {"metrics_show_tenants": "yes"}})
    with pytest.raises(ConfigError, match="unknown key 'service.metrics_show_tenant'"):
        config_from_dict({"service": {"metrics_show_tenant": True}})


def test_the_disk_tier_is_on_in_the_shipped_configs_and_sized_in_pages():
    for name in ("local.yaml", "multinode.yaml"):
        cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
        disk = cfg.store.disk
        assert disk.enabled and disk.policy == "write_back" and not disk.keep
        settings = disk.settings(cfg.store_layout().page_bytes)
        assert settings.pages == disk.bytes // cfg.store_layout().page_bytes
    assert KvmeshConfig().store.disk.settings(1000) is None  # off unless a config asks
    counted = config_from_dict({"store": {"disk": {"enabled": True, "pages": 7}}})
    assert counted.store.disk.settings(1000).pages == 7
    tiny_pages = config_from_dict({"store": {"disk": {"enabled": True, "bytes": 1 << 40}}})
    assert tiny_pages.store.disk.settings(8192).pages == 1 << 17  # bounded, whatever fits
