//! Running one test alone in a child process of the same test binary.
//!
//! Some tests depend on the process environment at a moment other tests cannot be kept away
//! from: a variable a device reads when it first opens, or one the test itself sets (setting a
//! variable while other threads may read the environment is unsound). Such a test calls
//! [`in_child`] first: in the parent it starts the binary again with `--exact <its name>` and
//! the variables it needs, checks that exactly that test passed there, and returns `false`;
//! in the child it returns `true` and the test runs its scenario, alone in a fresh process.

use std::ffi::OsStr;
use std::process::Command;

/// Names the test a child process was started for.
const CHILD_ENV: &str = "BURN_CACHING_ALLOC_TEST_CHILD";

/// `true` in the child started for `test` (its libtest name, `module::function`): run the
/// scenario. Otherwise runs `test` in a child with `envs` set (`None` removes a variable),
/// panics with the child's output unless that one test passed there, and returns `false`.
pub fn in_child(test: &str, envs: &[(&str, Option<&OsStr>)]) -> bool {
    if std::env::var_os(CHILD_ENV).is_some_and(|name| name == test) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = Command::new(exe);
    command
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD_ENV, test);
    for (name, value) in envs {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let output = command.output().expect("the test binary starts again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // What the child printed, for `--nocapture` (libtest captures it otherwise).
    print!("{stdout}");
    assert!(
        output.status.success() && stdout.contains("test result: ok. 1 passed"),
        "`{test}` in a child process: {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    false
}
