//! The offline viewer (`CachingAllocator::dump_html`) opened in a real headless browser
//! (Debian's `chromium`): the page's script runs without an error, draws the timeline and the
//! segment map with every block, and the numbers it shows equal `memory_stats`.

use std::path::PathBuf;
use std::process::Command;

use caching_alloc_engine::alloc::HistoryOptions;
use caching_alloc_engine::alloc::inspect::ViewerLayer;

use crate::ci::is_ci;
use crate::common::{MIB, allocator};
use crate::snapshot_pickle::inspect_workload;

/// The browser's rendered DOM of `page`, or `None` (with the reason printed) when there is no
/// browser outside CI.
pub(crate) fn rendered_dom(page: &std::path::Path) -> Option<String> {
    let browser = std::env::var("CHROMIUM").unwrap_or_else(|_| "chromium".into());
    if Command::new(&browser).arg("--version").output().is_err() {
        assert!(
            !is_ci(),
            "CI is set but {browser} is missing (apt-get install chromium)"
        );
        println!("skipped: {browser} is not installed (the viewer is checked in a real browser)");
        return None;
    }
    // A profile per page: two tests of one process rendering at once must not share one
    // (chromium refuses a profile another instance holds).
    let stem = page
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let profile =
        std::env::temp_dir().join(format!("viewer-profile-{}-{stem}", std::process::id()));
    let output = Command::new(&browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("the browser runs");
    let _ = std::fs::remove_dir_all(&profile);
    let dom = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && dom.contains("</html>"),
        "{browser} failed: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Some(dom)
}

/// The value of attribute `attr` on the first element whose opening tag contains `marker`.
pub(crate) fn attribute(dom: &str, marker: &str, attr: &str) -> String {
    let at = dom
        .find(marker)
        .unwrap_or_else(|| panic!("no element with {marker}"));
    let start = dom[..at].rfind('<').expect("an opening tag");
    let end = at + dom[at..].find('>').expect("the tag closes");
    let tag = &dom[start..end];
    let key = format!("{attr}=\"");
    let from = tag
        .find(&key)
        .unwrap_or_else(|| panic!("{tag} has no {attr}"))
        + key.len();
    tag[from..from + tag[from..].find('"').expect("quoted")].to_string()
}

#[test]
fn the_viewer_renders_in_chromium_and_shows_the_stats() {
    let (alloc, device) = allocator(256 * MIB, "");
    alloc.record_memory_history(HistoryOptions::default());
    let live = inspect_workload(&alloc, &device);
    let page: PathBuf = std::env::temp_dir().join(format!("viewer-{}.html", std::process::id()));
    let layer = ViewerLayer {
        name: "CubeCL layer: cached in free slices".into(),
        bytes: 3 * MIB,
    };
    alloc
        .dump_html_with_layers(&page, &[layer], &Default::default())
        .expect("written");
    let html = std::fs::read_to_string(&page).expect("read back");
    // Nothing to fetch: no external script, style, image or module (the SVG namespace URI is
    // a name, not a request).
    for loads in ["https://", " src=", "<link", "import ", "fetch("] {
        assert!(!html.contains(loads), "the page loads something: {loads}");
    }
    let Some(dom) = rendered_dom(&page) else {
        let _ = std::fs::remove_file(&page);
        return;
    };
    let _ = std::fs::remove_file(&page);

    assert!(
        dom.contains("<pre id=\"errors\"></pre>"),
        "script errors: {dom}"
    );
    assert_eq!(attribute(&dom, "<body", "data-rendered"), "ok");

    let snapshot = alloc.snapshot();
    let stats = &snapshot.stats;
    // Summary table.
    for (key, value) in [
        ("allocated", stats.allocated_bytes.all.current),
        ("reserved", stats.reserved_bytes.all.current),
        ("active", stats.active_bytes.all.current),
        ("peak_reserved", stats.reserved_bytes.all.peak),
    ] {
        let shown = attribute(&dom, &format!("data-key=\"{key}\""), "data-bytes");
        assert_eq!(shown, value.to_string(), "summary row {key}");
    }
    assert_eq!(
        attribute(&dom, "data-key=\"num_ooms\"", "data-count"),
        stats.num_ooms.to_string()
    );
    // Fragmentation of the free memory, as `free_space` reads it.
    let free = alloc.stats().free_space;
    for (key, pool) in [
        ("all", free.all),
        ("large_pool", free.large_pool),
        ("small_pool", free.small_pool),
    ] {
        let shown = attribute(
            &dom,
            &format!("data-key=\"fragmentation.{key}\""),
            "data-ppm",
        );
        let ppm = (pool.fragmentation() * 1e6).round() as u64;
        assert_eq!(shown, ppm.to_string(), "fragmentation row {key}");
    }
    assert_eq!(
        attribute(&dom, "data-key=\"layer\"", "data-bytes"),
        (3 * MIB).to_string()
    );
    // Timeline: its last points are the statistics now.
    assert!(dom.contains("id=\"timeline-svg\""));
    assert_eq!(
        attribute(&dom, "data-series=\"allocated\"", "data-last"),
        stats.allocated_bytes.all.current.to_string()
    );
    assert_eq!(
        attribute(&dom, "data-series=\"reserved\"", "data-last"),
        stats.reserved_bytes.all.current.to_string()
    );
    // Segment map: one rectangle per segment and per block, in each state.
    assert!(dom.contains("id=\"segments-svg\""));
    let blocks: usize = snapshot.segments.iter().map(|s| s.blocks.len()).sum();
    assert_eq!(dom.matches("class=\"block ").count(), blocks);
    assert_eq!(
        dom.matches("class=\"segment\"").count(),
        snapshot.segments.len()
    );
    for state in ["active_allocated", "active_pending_free", "inactive"] {
        assert!(
            dom.contains(&format!("data-state=\"{state}\"")),
            "a block {state}"
        );
    }
    for a in live {
        alloc.free(a).expect("live");
    }
}

/// Issue 33: `<!--<script>` in any string of a snapshot (here the title and a layer name) put
/// the page's data element in HTML's escaped state, which swallowed the viewer's own script
/// (a blank page). No `<` reaches the data element now, and the data still parses to the
/// strings given.
#[test]
fn markup_in_the_snapshots_strings_cannot_end_or_escape_the_data_element() {
    let (alloc, device) = allocator(256 * MIB, "");
    let _live = inspect_workload(&alloc, &device);
    let hostile = "<!--<script></script><b>";
    let layers = [ViewerLayer {
        name: hostile.into(),
        bytes: 7,
    }];
    let page =
        caching_alloc_engine::alloc::inspect::viewer_html(&alloc.snapshot(), hostile, &layers);
    let start = page.find("id=\"data\">").expect("the data element") + "id=\"data\">".len();
    let end = start + page[start..].find("</script>").expect("its end");
    let data = &page[start..end];
    assert!(!data.contains('<'), "a `<` in the data element: {data}");
    let parsed: serde_json::Value = serde_json::from_str(data).expect("the data is JSON");
    assert_eq!(parsed["title"], hostile);
    assert_eq!(parsed["layers"][0][0], hostile);
    // The page's script element follows, untouched.
    assert!(page[end..].contains("<script>\n"));
}
