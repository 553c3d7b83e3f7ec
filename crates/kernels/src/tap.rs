//! Observing the inputs of named linear layers while a model runs, for calibration that needs
//! activations inside a layer (activation-aware quantization reads the inputs of q/k/v,
//! gate/up and down). A tap is set per thread for the duration of one closure, so serving
//! threads never see it; when no tap is set the cost is one thread-local read per product.
//!
//! Model layers are opaque [`crate::QLinear`] calls, so observing at the product, by the
//! weight's canonical name, needs no hook in any architecture.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

type Observer = Box<dyn FnMut(&str, &Tensor) -> Result<()>>;

thread_local! {
    static TAP: RefCell<Option<Observer>> = const { RefCell::new(None) };
}

/// Runs `body` with `observer(name, input)` called for every named linear layer's input
/// (`[.., in_features]` f32) on this thread. The first error an observer returns is kept and
/// returned after `body`; observation stops at that error.
pub fn with_tap<R>(
    observer: impl FnMut(&str, &Tensor) -> Result<()> + 'static,
    body: impl FnOnce() -> R,
) -> Result<R> {
    let errors = std::rc::Rc::new(RefCell::new(None::<candle_core::Error>));
    let sink = std::rc::Rc::clone(&errors);
    let mut observer = observer;
    let wrapped: Observer = Box::new(move |name, x| {
        if sink.borrow().is_none() {
            if let Err(e) = observer(name, x) {
                *sink.borrow_mut() = Some(e);
            }
        }
        Ok(())
    });
    let previous = TAP.with(|t| t.borrow_mut().replace(wrapped));
    // Restore the previous tap even if `body` unwinds.
    struct Restore(Option<Observer>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            TAP.with(|t| *t.borrow_mut() = previous);
        }
    }
    let restore = Restore(previous);
    let out = body();
    drop(restore);
    let err = errors.borrow_mut().take();
    match err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Called by [`crate::QLinear`] with its name and input.
pub(crate) fn observe(name: &str, x: &Tensor) {
    TAP.with(|t| {
        if let Some(obs) = t.borrow_mut().as_mut() {
            // `with_tap`'s wrapper keeps errors; it never returns one.
            let _ = obs(name, x);
        }
    });
}

/// Whether a tap is set on this thread.
pub(crate) fn active() -> bool {
    TAP.with(|t| t.borrow().is_some())
}
