//! Modules and functions: `cuModuleLoadData` loads an image of the fake NVRTC (nothing else: a
//! kernel must be compiled by the fake to be launched on it), `cuModuleGetFunction` finds an
//! entry point, `cuFuncSetAttribute` records the dynamic shared memory a function may use.

use std::ffi::{CStr, c_char, c_int, c_void};

use super::device::attr;
use super::{check_out, out};
use crate::codes::*;
use crate::nvrtc::image::Image;
use crate::state::{FUNCTION_BASE, Function, MODULE_BASE, Module, call};

/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
const MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;

/// `cuLaunchKernel(<name>)`, interned: launches are logged and race-checked under it, and the
/// detector keeps `&'static str` names. One leaked string per distinct entry name.
fn label(name: &str) -> &'static str {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static LABELS: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let mut labels = LABELS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    labels
        .entry(name.to_string())
        .or_insert_with(|| Box::leak(format!("cuLaunchKernel({name})").into_boxed_str()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> u32 {
    call("cuModuleLoadData", |fake| {
        const NAME: &str = "cuModuleLoadData";
        let d = tri!(fake.context(NAME));
        tri!(check_out(fake, NAME, module));
        if image.is_null() {
            return fake.reject(NAME, INVALID_VALUE, "no image");
        }
        // SAFETY: PTX (and the fake's image) is NUL-terminated text; a binary image stops at its
        // first NUL byte, which is enough to tell that it is not the fake's.
        let text = unsafe { CStr::from_ptr(image as *const c_char) }.to_string_lossy();
        let parsed = match Image::parse(&text) {
            Ok(parsed) => parsed,
            Err(what) => return fake.reject(NAME, INVALID_IMAGE, what),
        };
        let (major, minor) = fake.config.compute_capability;
        let (major, minor) = (major as u32, minor as u32);
        if let Some(target) = parsed.target {
            let fits = if target.specific {
                (target.major, target.minor) == (major, minor)
            } else {
                (target.major, target.minor) <= (major, minor)
            };
            if !fits {
                return fake.reject(
                    NAME,
                    NO_BINARY_FOR_GPU,
                    format!("compiled for {target}, device {d} is sm_{major}{minor}"),
                );
            }
        }
        let handle = fake.next_handle(MODULE_BASE);
        fake.modules.insert(
            handle,
            Module {
                device: d,
                entries: parsed.entries,
            },
        );
        unsafe { out(module, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> u32 {
    call("cuModuleGetFunction", |fake| {
        const NAME: &str = "cuModuleGetFunction";
        let d = tri!(fake.context(NAME));
        tri!(check_out(fake, NAME, function));
        if name.is_null() {
            return fake.reject(NAME, INVALID_VALUE, "no name");
        }
        let wanted = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let Some(loaded) = fake.modules.get(&(module as u64)) else {
            return fake.reject(NAME, INVALID_HANDLE, "not a loaded module");
        };
        if loaded.device != d {
            let owner = loaded.device;
            return fake.reject(
                NAME,
                INVALID_CONTEXT,
                format!("a module of device {owner}'s context used in device {d}'s"),
            );
        }
        let Some(entry) = loaded.entries.iter().find(|e| e.name == wanted).cloned() else {
            let names: Vec<&str> = loaded.entries.iter().map(|e| e.name.as_str()).collect();
            let names = names.join(", ");
            return fake.reject(
                NAME,
                NOT_FOUND,
                format!("no entry point `{wanted}` in the module (it has: {names})"),
            );
        };
        let handle = fake.next_handle(FUNCTION_BASE);
        let shared = super::device::attribute(fake, attr::MAX_SHARED_MEMORY_PER_BLOCK, d);
        fake.functions.insert(
            handle,
            Function {
                module: module as u64,
                label: label(&entry.name),
                entry,
                max_dynamic_shared: shared as u32,
            },
        );
        unsafe { out(function, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> u32 {
    call("cuModuleUnload", |fake| {
        let _ = tri!(fake.context("cuModuleUnload"));
        if fake.modules.remove(&(module as u64)).is_none() {
            return fake.reject("cuModuleUnload", INVALID_HANDLE, "not a loaded module");
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncSetAttribute(
    function: *mut c_void,
    attribute: c_int,
    value: c_int,
) -> u32 {
    call("cuFuncSetAttribute", |fake| {
        const NAME: &str = "cuFuncSetAttribute";
        let d = tri!(fake.context(NAME));
        if !fake.functions.contains_key(&(function as u64)) {
            return fake.reject(NAME, INVALID_HANDLE, "not a function");
        }
        if attribute == MAX_DYNAMIC_SHARED_SIZE_BYTES {
            let most = super::device::attribute(fake, attr::MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, d);
            if value < 0 || value > most {
                return fake.reject(
                    NAME,
                    INVALID_VALUE,
                    format!("{value} bytes of dynamic shared memory: the device allows {most}"),
                );
            }
            let f = fake.functions.get_mut(&(function as u64)).expect("checked");
            f.max_dynamic_shared = value as u32;
        }
        SUCCESS
    })
}
