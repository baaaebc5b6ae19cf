//! The configuration string: good values, bad values, and what the errors say.

use crate::common::MIB;
use caching_alloc_engine::alloc::{
    AllocatorConfig, ConfigError, HistoryOptions, RecordMode, RoundupDivisions, StackContext,
};

use crate::child::in_child;

#[test]
fn parses_every_key() {
    let config = AllocatorConfig::parse(
        " max_split_size_mb:128 , garbage_collection_threshold:0.8,roundup_power2_divisions:4,\
         max_non_split_rounding_mb:30,per_process_memory_fraction:0.5,record_history:true,history_capacity:100",
    )
    .unwrap();
    assert_eq!(config.max_split_size, Some(128 * MIB));
    assert_eq!(config.garbage_collection_threshold, Some(0.8));
    assert_eq!(
        config.roundup_power2_divisions,
        RoundupDivisions::uniform(4)
    );
    assert_eq!(config.max_non_split_rounding, 30 * MIB);
    assert_eq!(config.memory_fraction, Some(0.5));
    // The two history keys set the one history setting: a trace of 100 events, no stacks.
    assert_eq!(config.history, HistoryOptions::trace(100));
}

/// The history keys map onto `HistoryOptions`: `history_capacity` alone sets the ring's size
/// of a recording that is off, in either order with `record_history`, and `false` turns a
/// recording off again.
#[test]
fn the_history_keys_set_the_history_options() {
    assert_eq!(AllocatorConfig::default().history, HistoryOptions::off());
    let sized = AllocatorConfig::parse("history_capacity:7").unwrap();
    assert_eq!(sized.history.enabled, RecordMode::Off);
    assert_eq!(sized.history.max_entries, 7);
    let either_order = AllocatorConfig::parse("history_capacity:7,record_history:1").unwrap();
    assert_eq!(either_order.history, HistoryOptions::trace(7));
    let off = AllocatorConfig::parse("record_history:false").unwrap();
    assert_eq!(off.history, HistoryOptions::off());
}

/// PyTorch 2.9's `parseMaxSplitSize` / `parseMaxNonSplitRoundingSize`: at least 20 MiB, and a
/// value too large for bytes is capped at `SIZE_MAX / 1 MiB` MiB.
#[test]
fn split_sizes_accept_20_mib_and_cap_huge_values() {
    let config =
        AllocatorConfig::parse("max_split_size_mb:20,max_non_split_rounding_mb:20").unwrap();
    assert_eq!(config.max_split_size, Some(20 * MIB));
    assert_eq!(config.max_non_split_rounding, 20 * MIB);
    let config = AllocatorConfig::parse(&format!("max_split_size_mb:{}", u64::MAX)).unwrap();
    assert_eq!(config.max_split_size, Some(u64::MAX / MIB * MIB));
}

#[test]
fn empty_string_gives_the_defaults() {
    assert_eq!(
        AllocatorConfig::parse("").unwrap(),
        AllocatorConfig::default()
    );
    assert_eq!(
        AllocatorConfig::parse("  ").unwrap(),
        AllocatorConfig::default()
    );
    let d = AllocatorConfig::default();
    assert_eq!(d.max_split_size, None);
    assert_eq!(d.max_non_split_rounding, 20 * MIB);
}

#[test]
fn rejects_malformed_unknown_and_out_of_range_values() {
    let cases: &[(&str, &str)] = &[
        ("max_split_size_mb", "no colon"),
        ("max_split_size_mb:", "empty value"),
        (":5", "empty key"),
        ("max_split_size_mb:128,,record_history:true", "empty item"),
        (
            "max_split_size_mb:19",
            "under 20 MiB (PyTorch 2.9's parseMaxSplitSize)",
        ),
        ("max_non_split_rounding_mb:19", "under 20 MiB"),
        ("max_split_size_mb:99999999999999999999", "beyond 64 bits"),
        ("max_split_size_mb:-5", "negative"),
        ("max_split_size_mb:abc", "not a number"),
        ("garbage_collection_threshold:0", "zero"),
        ("garbage_collection_threshold:1.0", "one"),
        ("garbage_collection_threshold:1.5", "over one"),
        ("per_process_memory_fraction:0", "zero fraction"),
        ("per_process_memory_fraction:1.01", "fraction over one"),
        ("per_process_memory_fraction:nan", "NaN"),
        ("roundup_power2_divisions:3", "not a power of two"),
        (
            "roundup_power2_divisions:0",
            "a single value must be a power of two",
        ),
        (
            "roundup_power2_divisions:[64:3]",
            "list divisions are 0 or a power of two",
        ),
        (
            "roundup_power2_divisions:[0:4]",
            "key 0 is not a power of two",
        ),
        ("roundup_power2_divisions:[64:4", "unclosed bracket"),
        (
            "roundup_power2_divisions:[48:4,>:8]",
            "bound not a power of two",
        ),
        ("record_history:maybe", "not a bool"),
        ("history_capacity:0", "zero capacity"),
        ("max_split_size_mb:128,max_split_size_mb:256", "duplicate"),
        ("max_splt_size_mb:128", "typo"),
        ("expandable_segments:maybe", "not True or False"),
        ("segment_sizing:Grow", "names are lower case"),
        ("segment_sizing:20", "not a rule name"),
        ("pool_borrowing:yes", "not True or False"),
        ("release_lock_on_cudamalloc:True", "unsupported mode"),
    ];
    for (text, why) in cases {
        assert!(
            AllocatorConfig::parse(text).is_err(),
            "`{text}` ({why}) must be rejected"
        );
    }
}

#[test]
fn segment_sizing_names_the_rule_and_old_files_read_as_pytorch() {
    use caching_alloc_engine::alloc::SegmentSizing;
    assert_eq!(
        AllocatorConfig::parse("segment_sizing:pytorch")
            .unwrap()
            .segment_sizing,
        SegmentSizing::Pytorch
    );
    assert_eq!(
        AllocatorConfig::parse("segment_sizing:grow")
            .unwrap()
            .segment_sizing,
        SegmentSizing::Grow
    );
    assert_eq!(
        AllocatorConfig::parse("segment_sizing:fast").unwrap_err(),
        ConfigError::InvalidValue {
            key: "segment_sizing".into(),
            value: "fast".into(),
            expected: "grow or pytorch".into(),
        }
    );
    // A configuration serialised before the key existed (in a snapshot) used PyTorch's rule.
    let mut json = serde_json::to_value(AllocatorConfig::default()).unwrap();
    assert_eq!(json["segment_sizing"], "grow");
    json.as_object_mut().unwrap().remove("segment_sizing");
    let old: AllocatorConfig = serde_json::from_value(json).unwrap();
    assert_eq!(old.segment_sizing, SegmentSizing::Pytorch);
}

/// Our boolean rules (`pool_borrowing`, `cross_stream_reuse`, `release_outgrown`): on by default, off by their key, a bad value an error naming the key,
/// and a configuration serialised before the key existed (in a snapshot) reads back with
/// PyTorch's rule (off).
#[test]
fn our_rules_are_on_by_default_and_old_files_read_as_pytorch() {
    type Rule = fn(&AllocatorConfig) -> bool;
    let rules: [(&str, &str, Rule); 3] = [
        ("pool_borrowing", "off", |c| c.pool_borrowing),
        ("cross_stream_reuse", "yes", |c| c.cross_stream_reuse),
        ("release_outgrown", "2", |c| c.release_outgrown),
    ];
    for (key, bad, rule) in rules {
        assert!(rule(&AllocatorConfig::default()), "{key}");
        for off in ["False", "false", "0"] {
            assert!(
                !rule(&AllocatorConfig::parse(&format!("{key}:{off}")).unwrap()),
                "{key}:{off}"
            );
        }
        assert_eq!(
            AllocatorConfig::parse(&format!("{key}:{bad}")).unwrap_err(),
            ConfigError::InvalidValue {
                key: key.into(),
                value: bad.into(),
                expected: "True or False".into(),
            }
        );
        let mut json = serde_json::to_value(AllocatorConfig::default()).unwrap();
        assert_eq!(json[key], true, "{key}");
        json.as_object_mut().unwrap().remove(key);
        let old: AllocatorConfig = serde_json::from_value(json).unwrap();
        assert!(!rule(&old), "{key} of an old file");
    }
}

#[test]
fn errors_name_the_key_and_the_accepted_range() {
    let err = AllocatorConfig::parse("garbage_collection_threshold:1.5").unwrap_err();
    assert_eq!(
        err,
        ConfigError::InvalidValue {
            key: "garbage_collection_threshold".into(),
            value: "1.5".into(),
            expected: "a number in (0, 1)".into(),
        }
    );
    assert_eq!(
        err.to_string(),
        "invalid value `1.5` for allocator config key `garbage_collection_threshold`: expected a number in (0, 1)"
    );
    let err = AllocatorConfig::parse("per_process_memory_fraction:2").unwrap_err();
    assert!(err.to_string().contains("(0, 1]"), "{err}");
    let err = AllocatorConfig::parse("max_split_size_mb:8").unwrap_err();
    assert!(err.to_string().contains("at least 20"), "{err}");
    let err = AllocatorConfig::parse("max_splt_size_mb:128").unwrap_err();
    assert!(matches!(err, ConfigError::UnknownKey { ref key } if key == "max_splt_size_mb"));
    assert!(
        err.to_string().contains("max_split_size_mb"),
        "lists the known keys: {err}"
    );
}

#[test]
fn from_env_reads_the_variable() {
    // The test sets the variable, which is unsound while other threads may read the
    // environment: it runs alone in a child process of this binary, started without it.
    if !in_child("config::from_env_reads_the_variable", &[(CONF, None)]) {
        return;
    }
    // SAFETY: this process runs this test alone, and nothing else reads the environment.
    unsafe { std::env::set_var(CONF, "max_split_size_mb:64") };
    assert_eq!(
        AllocatorConfig::from_env().unwrap().max_split_size,
        Some(64 * MIB)
    );
    unsafe { std::env::set_var(CONF, "bogus") };
    assert!(AllocatorConfig::from_env().is_err());
    unsafe { std::env::remove_var(CONF) };
    assert_eq!(
        AllocatorConfig::from_env().unwrap(),
        AllocatorConfig::default()
    );
}

const CONF: &str = caching_alloc_engine::alloc::CONFIG_ENV;

/// Issue 20 point 6: `history_capacity` accepted up to 2^32 entries (hundreds of GiB of ring);
/// the most is 2^24 now, and the error says so.
#[test]
fn history_capacity_is_capped_at_2_to_the_24() {
    use caching_alloc_engine::alloc::MAX_HISTORY_CAPACITY;
    assert_eq!(MAX_HISTORY_CAPACITY, 1 << 24);
    let most = AllocatorConfig::parse("history_capacity:16777216").unwrap();
    assert_eq!(most.history.max_entries, 1 << 24);
    let err = AllocatorConfig::parse("history_capacity:16777217").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid value `16777217` for allocator config key `history_capacity`: expected a \
         whole number from 1 to 16777216"
    );
    assert!(AllocatorConfig::parse("history_capacity:4294967296").is_err());
}

/// `SegmentSizing::name` is the config string's name: parsing it gives the rule back.
#[test]
fn each_segment_sizing_parses_from_its_name() {
    use caching_alloc_engine::alloc::SegmentSizing;
    for rule in [SegmentSizing::Grow, SegmentSizing::Pytorch] {
        let config = AllocatorConfig::parse(&format!("segment_sizing:{}", rule.name()));
        assert_eq!(config.unwrap().segment_sizing, rule, "{}", rule.name());
    }
}

/// `history_options` reports the recording in force: the configuration's keys at start-up,
/// then whatever `record_memory_history` last asked for, and off once it was stopped.
#[test]
fn history_options_follow_the_configuration_and_record_memory_history() {
    let (alloc, _device) =
        crate::common::allocator(1 << 30, "record_history:true,history_capacity:7");
    assert_eq!(alloc.history_options(), HistoryOptions::trace(7));
    let (plain, _device) = crate::common::allocator(1 << 30, "");
    assert_eq!(plain.history_options(), HistoryOptions::off());

    let with_stacks = HistoryOptions::trace(5).with_context(StackContext::Alloc);
    plain.record_memory_history(with_stacks);
    assert_eq!(plain.history_options(), with_stacks);
    plain.record_memory_history(HistoryOptions::off());
    assert_eq!(plain.history_options(), HistoryOptions::off());
}

/// Issue 33: `record_history` accepted only `true`/`1`/`false`/`0`, where every other boolean
/// key also accepts PyTorch's `True`/`False`.
#[test]
fn record_history_accepts_pythons_booleans_like_every_other_boolean() {
    for (value, mode) in [
        ("True", RecordMode::All),
        ("true", RecordMode::All),
        ("1", RecordMode::All),
        ("False", RecordMode::Off),
        ("false", RecordMode::Off),
        ("0", RecordMode::Off),
    ] {
        let config = AllocatorConfig::parse(&format!("record_history:{value}"))
            .unwrap_or_else(|err| panic!("record_history:{value}: {err}"));
        assert_eq!(config.history.enabled, mode, "record_history:{value}");
    }
    assert!(AllocatorConfig::parse("record_history:yes").is_err());
}

/// Issue 33: `per_process_memory_fraction:1e-320` (a subnormal number, greater than 0) was
/// accepted and made a limit of 0 bytes.
#[test]
fn a_subnormal_memory_fraction_is_refused() {
    for value in ["1e-320", "4.9e-324"] {
        assert!(
            matches!(
                AllocatorConfig::parse(&format!("per_process_memory_fraction:{value}")),
                Err(ConfigError::InvalidValue { .. })
            ),
            "{value}"
        );
    }
    assert!(AllocatorConfig::parse("per_process_memory_fraction:1e-300").is_ok());
}

/// Issue 33: an `AllocatorConfig` built in code or with serde skipped the parser's checks; the
/// allocator took divisions of 3 (blocks that are not multiples of 512 bytes), a split size of
/// 1 MiB, a fraction of 2. `CachingAllocator::new` refuses them now, with the parser's error.
#[test]
fn a_configuration_built_in_code_or_deserialised_is_checked_like_a_parsed_one() {
    use caching_alloc_engine::alloc::CachingAllocator;
    use caching_alloc_engine::device::sim::SimDevice;

    let start = |config: AllocatorConfig| CachingAllocator::new(SimDevice::new(64 * MIB), config);
    let mut json: serde_json::Value =
        serde_json::to_value(AllocatorConfig::default()).expect("serialises");
    json["roundup_power2_divisions"]["buckets"] = serde_json::Value::from(vec![3u64; 16]);
    let three: AllocatorConfig = serde_json::from_value(json).expect("serde takes it");
    assert_eq!(three.roundup_power2_divisions.for_size(4 * MIB), 3);
    let err = start(three.clone())
        .err()
        .expect("divisions of 3 are refused");
    assert!(err.to_string().contains("power of two"), "{err}");
    assert!(three.validate().is_err());

    let mut small_split = AllocatorConfig::default();
    small_split.max_split_size = Some(MIB);
    assert!(start(small_split).is_err());
    let mut rounding = AllocatorConfig::default();
    rounding.max_non_split_rounding = 0;
    assert!(start(rounding).is_err());
    for fraction in [0.0, 2.0, f64::NAN, 1e-320] {
        let mut config = AllocatorConfig::default();
        config.memory_fraction = Some(fraction);
        assert!(start(config).is_err(), "memory fraction {fraction}");
    }
    for threshold in [0.0, 1.0, -0.5] {
        let mut config = AllocatorConfig::default();
        config.garbage_collection_threshold = Some(threshold);
        assert!(start(config).is_err(), "threshold {threshold}");
    }
    // What the parser accepts, the allocator accepts.
    let parsed = AllocatorConfig::parse(
        "max_split_size_mb:20,roundup_power2_divisions:[1:2,16:8,>:4],\
         garbage_collection_threshold:0.5,per_process_memory_fraction:1",
    )
    .expect("parses");
    parsed.validate().expect("valid");
    start(parsed).expect("starts");
    start(AllocatorConfig::default()).expect("starts");
}

/// The pinned host pool's keys (CUDA's staging buffers): PyTorch's
/// `pinned_max_cached_size_mb` and `pinned_reserve_segment_size_mb` (parsed by PyTorch's
/// `AcceleratorAllocatorConfig::parseArgs` as MiB, 0 allowed) and ours, `pinned_max_idle_mb`.
#[test]
fn the_pinned_host_keys_parse_as_mib_with_0_allowed() {
    use caching_alloc_engine::alloc::PinnedHostConfig;

    let defaults = PinnedHostConfig::default();
    assert_eq!(defaults.max_idle, 256 * MIB);
    assert_eq!(defaults.max_cached_size, None);
    assert_eq!(defaults.reserve_segment, 0);
    assert_eq!(AllocatorConfig::default().pinned, defaults);

    let config = AllocatorConfig::parse(
        "pinned_max_idle_mb:0,pinned_max_cached_size_mb:4,pinned_reserve_segment_size_mb:32",
    )
    .unwrap();
    assert_eq!(config.pinned.max_idle, 0);
    assert_eq!(config.pinned.max_cached_size, Some(4 * MIB));
    assert_eq!(config.pinned.reserve_segment, 32 * MIB);
    assert_eq!(
        AllocatorConfig::parse("pinned_max_cached_size_mb:0")
            .unwrap()
            .pinned
            .max_cached_size,
        Some(0)
    );
    for bad in [
        "pinned_max_idle_mb:-1",
        "pinned_max_idle_mb:1.5",
        "pinned_max_cached_size_mb:lots",
        "pinned_reserve_segment_size_mb:99999999999999999999",
    ] {
        let err = AllocatorConfig::parse(bad).unwrap_err();
        let key = bad.split(':').next().unwrap();
        assert!(
            matches!(err, ConfigError::InvalidValue { key: ref k, .. } if k == key),
            "{bad}: {err}"
        );
        assert!(err.to_string().contains("whole number"), "{err}");
    }
    // Still PyTorch's: `pinned_use_cuda_host_register` names a mode this pool does not have.
    assert!(matches!(
        AllocatorConfig::parse("pinned_use_cuda_host_register:True"),
        Err(ConfigError::Unsupported { .. })
    ));
    // Files written before the keys existed read as the defaults.
    let mut json: serde_json::Value =
        serde_json::to_value(AllocatorConfig::default()).expect("serialises");
    json.as_object_mut().unwrap().remove("pinned");
    json.as_object_mut()
        .unwrap()
        .remove("no_cuda_memory_caching");
    let old: AllocatorConfig = serde_json::from_value(json).expect("reads");
    assert_eq!(old, AllocatorConfig::default());
}

/// `AllocatorConfig::pytorch()` is every rule PyTorch's: the four keys whose defaults are ours
/// at PyTorch's values, `expandable_segments` off, everything else at the defaults (which are PyTorch's), and the same as
/// its string `PYTORCH_CONFIG`.
#[test]
fn the_pytorch_preset_sets_every_key_of_ours_to_pytorchs_rule() {
    use caching_alloc_engine::alloc::{PYTORCH_CONFIG, SegmentSizing};
    let pytorch = AllocatorConfig::pytorch();
    assert_eq!(pytorch, AllocatorConfig::parse(PYTORCH_CONFIG).unwrap());
    assert!(!pytorch.expandable_segments);
    assert_eq!(pytorch.segment_sizing, SegmentSizing::Pytorch);
    assert!(!pytorch.pool_borrowing);
    assert!(!pytorch.cross_stream_reuse);
    assert!(!pytorch.release_outgrown);
    // Everything else as the defaults.
    let mut ours = AllocatorConfig::default();
    ours.segment_sizing = SegmentSizing::Pytorch;
    ours.pool_borrowing = false;
    ours.cross_stream_reuse = false;
    ours.release_outgrown = false;
    assert_eq!(pytorch, ours);
}

/// `cross_stream_lending` is gone (lending is part of `cross_stream_reuse`): the key is unknown,
/// and a configuration serialised while it existed reads back without it.
#[test]
fn the_removed_lending_key_is_an_unknown_key_and_old_files_still_read() {
    use caching_alloc_engine::alloc::ConfigError;
    let err = AllocatorConfig::parse("cross_stream_lending:false").unwrap_err();
    assert!(
        matches!(&err, ConfigError::UnknownKey { key } if key == "cross_stream_lending"),
        "{err}"
    );
    let mut json = serde_json::to_value(AllocatorConfig::default()).unwrap();
    json.as_object_mut().unwrap().insert(
        "cross_stream_lending".into(),
        serde_json::Value::Bool(false),
    );
    let old: AllocatorConfig = serde_json::from_value(json).unwrap();
    assert_eq!(old, AllocatorConfig::default());
}

/// One rule for keys an old serialised configuration lacks: it reads them back as
/// `AllocatorConfig::pytorch()` has them. A file holding only PyTorch's own fields (a trace or
/// snapshot written before any key of ours existed) deserialises to the preset exactly.
#[test]
fn a_serialised_configuration_without_our_keys_reads_back_as_the_pytorch_preset() {
    let pytorch = AllocatorConfig::pytorch();
    let mut json = serde_json::to_value(&pytorch).unwrap();
    let fields = json.as_object_mut().unwrap();
    for ours in [
        "history",
        "expandable_segments",
        "segment_sizing",
        "pool_borrowing",
        "cross_stream_reuse",
        "release_outgrown",
        "throw_on_cudamalloc_oom",
        "no_cuda_memory_caching",
        "pinned",
    ] {
        assert!(fields.remove(ours).is_some(), "{ours} is serialised");
    }
    let old: AllocatorConfig = serde_json::from_value(json).unwrap();
    assert_eq!(old, pytorch);
}
