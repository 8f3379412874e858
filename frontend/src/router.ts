// Hash navigation shared by the pages (main.ts renders the page for the current hash).
export type Cleanup = () => void;

const listeners: (() => void)[] = [];
export function onRerender(fn: () => void): void { listeners.push(fn); }

export function navigate(hash: string): void {
  if (location.hash === hash) listeners.forEach((fn) => fn());
  else location.hash = hash;
}
